"""Transport security: mutual TLS for the gRPC links (see tls.py)."""
