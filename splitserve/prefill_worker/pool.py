"""`splitserve prefill-pool`: the Ray driver of the prefill pool (runs on the KubeRay head).

Keeps prefill actors alive on the Ray cluster: --replicas of them, or with
--one-per-worker-node one actor pinned to each live Ray worker node (what the operator
uses: it scales the KubeRay worker group, and the pool follows the nodes). Ray restarts
a crashed actor (max_restarts); one gone for good is replaced; actors of vanished nodes
are dropped. Each actor serves gRPC on its node and registers itself on the bus, so
routers reach it directly. Metrics of the pool itself on --metrics-port (/metrics, /health).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

from splitserve.core.cli_types import OneLineParser
from splitserve.core.ports import PREFILL_ADMIN_PORT
from splitserve.core.tracing_config import add_tracing_args, tracing_config_from_args
from splitserve.engine.args import (
    add_engine_args,
    async_scheduling_problem,
    compatibility_problem,
    engine_config_from_args,
    resolve_model,
    tensor_parallel_problem,
)
from splitserve.engine.kv_offload.args import kv_offload_problem
from splitserve.engine.lora.args import lora_problem
from splitserve.logs import configure_logging, keep_output_lines_whole
from splitserve.metrics import Metrics
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from splitserve.security.links import add_security_args, security_from_args

log = logging.getLogger("splitserve.prefill_pool")


def serve_metrics(port: int, registry: CollectorRegistry, healthy) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                body, code = generate_latest(registry), 200
            elif self.path == "/health":
                body, code = (b"ok", 200) if healthy() else (b"no prefill actor alive", 503)
            else:
                body, code = b"not found", 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    import ray

    from splitserve.worker_base.actor import WorkerActor

    ap = OneLineParser(prog="splitserve prefill-pool", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    ap.add_argument("--kv-protocol", choices=["tcp", "rdma"], default="tcp", help="mooncake transport")
    ap.add_argument("--rdma-device")
    ap.add_argument("--one-per-worker-node", action="store_true",
                    help="one actor per live Ray worker node (ignores --replicas once worker nodes exist)")
    ap.add_argument("--port", type=int, default=50051, help="gRPC port of each prefill actor (0: any)")
    ap.add_argument("--metrics-port", type=int, default=8081, help="the pool driver's own /metrics")
    ap.add_argument("--worker-metrics-port", type=int, default=PREFILL_ADMIN_PORT, help="each prefill actor's /metrics")
    ap.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"))
    ap.add_argument("--gpus-per-worker", type=float, default=0.0)
    add_security_args(ap)
    add_tracing_args(ap)
    args = ap.parse_args(argv)
    configure_logging()
    if args.replicas < 0:
        raise SystemExit("--replicas must be >= 0")
    problem = (compatibility_problem(args, prefill_role=True) or tensor_parallel_problem(args) or kv_offload_problem(args)
               or lora_problem(args) or async_scheduling_problem(args))
    if problem:
        raise SystemExit(f"splitserve prefill-pool: {problem}")
    tp = args.tensor_parallel_size
    if args.device.startswith("cuda") and tp > 1 and args.gpus_per_worker < tp:  # its ranks take cuda:0..tp-1
        raise SystemExit(f"splitserve prefill-pool: --tensor-parallel-size {tp} needs --gpus-per-worker {tp} "
                         f"(one GPU per rank), got {args.gpus_per_worker:g}")
    model, served = resolve_model(args)
    engine = engine_config_from_args(args, model, served)
    security = security_from_args(args)  # TLS files / token must exist at the same paths on every Ray node
    keep_output_lines_whole()  # Ray prints its actors' lines from a thread of its own
    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    metrics = Metrics(CollectorRegistry())
    actors: dict[str, object] = {}

    def wanted() -> dict[str, str | None]:
        """slot name -> node id to pin to (None: anywhere)."""
        if args.one_per_worker_node:
            nodes = [n["NodeID"] for n in ray.nodes()
                     if n["Alive"] and "node:__internal_head__" not in n.get("Resources", {})]
            if nodes:
                return {f"node-{n[:12]}": n for n in nodes}
        return {f"slot-{i}": None for i in range(args.replicas)}

    def spawn(slot: str, node_id: str | None):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg = PrefillWorkerConfig(engine, worker_id=f"{args.cluster}-prefill-{slot}", host="0.0.0.0", port=args.port,
                                  advertise_host=None, bus_url=args.redis_url, cluster=args.cluster,
                                  admin_port=args.worker_metrics_port, kv_protocol=args.kv_protocol,
                                  rdma_device=args.rdma_device, security=security,
                                  tracing=tracing_config_from_args(args, "splitserve prefill-pool"),
                                  engine_process=None)  # the CPU default: its own process (engine_process.py)
        # Ray reserves one CPU per actor (num_cpus=1): one torch thread unless --torch-threads says more
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)} if node_id else {}
        return WorkerActor.options(name=f"prefill-{slot}", lifetime="detached", get_if_exists=True, num_cpus=1,
                                   num_gpus=args.gpus_per_worker, **placement).remote(PrefillWorker, cfg,
                                                                                      args.torch_threads or 1)

    serve_metrics(args.metrics_port, metrics.registry, lambda: bool(actors))
    while True:  # reconcile the actors against the slots
        slots = wanted()
        for slot, node_id in slots.items():
            if slot not in actors:
                actors[slot] = spawn(slot, node_id)
            try:
                ray.get(actors[slot].address.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("prefill actor %s is not answering (%s); replacing it", slot, exc)
                ray.kill(actors.pop(slot), no_restart=True)
        for slot in [s for s in actors if s not in slots]:  # scaled down, or its node left
            log.info("prefill actor %s no longer wanted; stopping it", slot)
            try:
                ray.get(actors[slot].stop.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - its node may be gone already
                log.warning("prefill actor %s did not stop cleanly: %s", slot, exc)
            ray.kill(actors.pop(slot), no_restart=True)
        metrics.prefill_pool_actors.set(len(actors))
        time.sleep(5)
