"""`splitserve decode-worker`: one decode worker (cluster mode, a Kubernetes Deployment).

Admin HTTP (--admin-port): GET /health (200 ready, 503 starting or draining),
GET /metrics, GET /drain (stop admitting, leave the registry, return 200 once every
stream has finished; the pod's preStop hook calls it before SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine.args import add_engine_args, engine_config_from_args, resolve_model


def admin_app(worker: DecodeWorker, drain_timeout: float) -> web.Application:
    async def health(request):
        ok = bool(worker.address) and not worker.draining
        status = "ok" if ok else ("draining" if worker.draining else "starting")
        return web.json_response({"status": status, "worker_id": worker.worker_id,
                                  "streams": len(worker.streams)}, status=200 if ok else 503)

    async def metrics(request):
        return web.Response(body=generate_latest(worker.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def drain(request):
        done = await worker.drain(drain_timeout)
        return web.json_response({"drained": done, "streams_left": len(worker.streams)}, status=200 if done else 504)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/drain", drain)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve decode-worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("--admin-port", type=int, default=8081)
    ap.add_argument("--advertise-host", default=os.environ.get("POD_IP"),
                    help="address other components dial (default: $POD_IP, else --host)")
    ap.add_argument("--worker-id", default=os.environ.get("POD_NAME") or f"decode-{socket.gethostname()}")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    ap.add_argument("--kv-protocol", choices=["tcp", "rdma"], default="tcp", help="mooncake transport")
    ap.add_argument("--rdma-device", help="RDMA device for mooncake, e.g. mlx5_0")
    ap.add_argument("--drain-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.torch_threads)
    model, served = resolve_model(args)
    advertise = args.advertise_host or (None if args.host == "0.0.0.0" else args.host) or socket.gethostname()
    config = DecodeWorkerConfig(engine_config_from_args(args, model, served), worker_id=args.worker_id,
                                host=args.host, port=args.port, advertise_host=advertise, bus_url=args.redis_url,
                                cluster=args.cluster, kv_backend=args.kv_backend, kv_protocol=args.kv_protocol,
                                rdma_device=args.rdma_device)

    async def amain() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        worker = DecodeWorker(config)
        runner = web.AppRunner(admin_app(worker, args.drain_timeout), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.admin_port).start()
        await worker.start()
        await stop.wait()
        await worker.drain(args.drain_timeout)
        await worker.stop()
        await runner.cleanup()

    asyncio.run(amain())
    return 0
