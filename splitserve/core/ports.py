"""Default ports every component agrees on: the worker CLIs listen on them and the
operator renders pods, probes and hooks against them."""

ROUTER_PORT = 8000  # OpenAI HTTP API
PREFILL_GRPC_PORT = 50051
DECODE_GRPC_PORT = 50052
ADMIN_PORT = 8081  # a worker's /health, /livez, /metrics (and the prefill pool's)
PREFILL_ADMIN_PORT = 8082  # each prefill worker's /health, /livez, /metrics
DRAIN_PORT = 8083  # a decode worker's /drain, on 127.0.0.1 only
REDIS_PORT = 6379
