"""`splitserve prefill-pool`: the Ray driver of the prefill pool (runs on the KubeRay head).

Keeps --replicas prefill actors alive on the Ray cluster: Ray restarts a crashed actor
(max_restarts); an actor that is gone for good is replaced. Each actor serves gRPC on
its node and registers itself on the bus, so routers reach it directly.
Metrics of the pool itself on --metrics-port (/metrics, /health).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from splitserve.engine.args import add_engine_args, engine_config_from_args, resolve_model
from splitserve.prefill_worker.worker import PrefillWorkerConfig

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

    from splitserve.cluster.actors import WorkerActor

    ap = argparse.ArgumentParser(prog="splitserve prefill-pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    ap.add_argument("--rdma-device")
    ap.add_argument("--port", type=int, default=50051, help="gRPC port of each prefill actor (0: any)")
    ap.add_argument("--metrics-port", type=int, default=8081, help="the pool driver's own /metrics")
    ap.add_argument("--worker-metrics-port", type=int, default=8082, help="each prefill actor's /metrics")
    ap.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"))
    ap.add_argument("--gpus-per-worker", type=float, default=0.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas < 0:
        raise SystemExit("--replicas must be >= 0")
    model, served = resolve_model(args)
    engine = engine_config_from_args(args, model, served)
    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    registry = CollectorRegistry()
    alive = Gauge("splitserve_prefill_pool_actors", "Prefill actors alive in the pool.", registry=registry)
    actors: dict[int, object] = {}

    def spawn(i: int):
        cfg = PrefillWorkerConfig(engine, worker_id=f"{args.cluster}-prefill-{i}", host="0.0.0.0", port=args.port,
                                  advertise_host=None, bus_url=args.redis_url, cluster=args.cluster,
                                  metrics_port=args.worker_metrics_port)
        actor = WorkerActor.options(name=f"prefill-{i}", lifetime="detached", get_if_exists=True,
                                    num_cpus=1, num_gpus=args.gpus_per_worker).remote("prefill", cfg,
                                                                                      args.torch_threads)
        return actor

    serve_metrics(args.metrics_port, registry, lambda: bool(actors))
    while True:  # reconcile: one actor per replica slot, replaced when dead for good
        for i in range(args.replicas):
            if i not in actors:
                actors[i] = spawn(i)
            try:
                ray.get(actors[i].address.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("prefill actor %d is not answering (%s); replacing it", i, exc)
                ray.kill(actors.pop(i), no_restart=True)
        for i in [i for i in actors if i >= args.replicas]:  # scaled down
            ray.get(actors[i].stop.remote(), timeout=60)
            ray.kill(actors.pop(i), no_restart=True)
        alive.set(len(actors))
        time.sleep(5)
