"""Transport security of the gRPC links: mutual TLS (tls.py) and the cluster token,
bundled per process as a LinkSecurity (links.py)."""
