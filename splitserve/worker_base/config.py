"""Settings every worker has, whatever its role."""

from __future__ import annotations

import argparse
import socket
import uuid
from dataclasses import dataclass, field

from splitserve.core.tracing_config import TracingConfig
from splitserve.engine.config import EngineConfig
from splitserve.security.links import NO_SECURITY, LinkSecurity


@dataclass
class WorkerConfig:
    engine: EngineConfig
    worker_id: str = ""  # "": <role>-<hostname>-<random>
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0: any free port
    advertise_host: str | None = None  # address routers and peers dial (default: host)
    bus_url: str | None = None
    cluster: str = "local"
    heartbeat_ttl_s: float = 6.0
    admin_port: int | None = None  # /health and /metrics; 0: any free port; None: off
    security: LinkSecurity = field(default_factory=lambda: NO_SECURITY)  # mTLS / cluster token on every gRPC link
    kv_backend: str = "grpc"
    kv_protocol: str = "tcp"  # mooncake transport: tcp | rdma
    rdma_device: str | None = None
    # A step running longer than this marks the engine stalled: /health says 503 and the
    # worker leaves the registry until it recovers. Long enough for a first CUDA step that
    # compiles kernels; lower it where steps are known to be short.
    engine_stall_timeout_s: float = 120.0
    # An engine process that answers no heartbeat for this long (frozen, hung in a system
    # call) makes the worker unhealthy the same way, idle or not (engine_process.py); so does
    # a tensor-parallel rank process (each beats on its own: parallel/worker.py).
    engine_heartbeat_timeout_s: float = 10.0
    # The engine loop in a child process (engine/engine_process.py): True, False, or None for
    # the default (on the CPU: yes; on CUDA: a thread). The CLIs and `serve` leave it None;
    # tests that reach into the engine object pin it to False.
    engine_process: bool | None = False
    tracing: TracingConfig | None = None  # OTLP export of this worker's spans (core/tracing.py); None: off

    role = ""  # set by each subclass

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def advertised_host(host: str, advertise: str | None) -> str:
    """The address other components dial: explicit, else the bind address unless it is
    a wildcard, else this node's address (a Ray node or pod IP)."""
    if advertise:
        return advertise
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


ENGINE_LOOPS = {"auto": None, "process": True, "thread": False}


def add_worker_health_args(ap: argparse.ArgumentParser) -> None:
    """Flags of a worker's engine loop and health checks, the same for every command that
    starts workers."""
    ap.add_argument("--engine-loop", choices=tuple(ENGINE_LOOPS), default="auto",
                    help="where the engine loop runs: 'process' (its own process, free of the worker's GIL), "
                         "'thread' (a thread of the worker); auto: process on the CPU, thread on CUDA "
                         "(default: %(default)s)")
    ap.add_argument("--engine-heartbeat-timeout", type=float, default=WorkerConfig.engine_heartbeat_timeout_s,
                    help="seconds an engine process (--engine-loop process) or a tensor-parallel rank process may "
                         "go without answering its worker's heartbeat, idle or busy, before the worker reports itself "
                         "unhealthy (503 on /health, out of the registry, its streams migrate) until it answers "
                         "again; 0: off (default: %(default)s)")
    ap.add_argument("--engine-stall-timeout", type=float, default=WorkerConfig.engine_stall_timeout_s,
                    help="seconds one engine step may run before its worker reports itself stalled (503 on "
                         "/health and /livez, out of the registry); twice that and it exits to be restarted "
                         "(default: %(default)s)")
