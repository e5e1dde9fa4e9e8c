"""Decode worker admin HTTP.

- Admin port (scraped; reachable by whatever the NetworkPolicy lets in): GET /health
  (200 ready, 503 starting or draining; block accounting under "kv") and GET /metrics.
- Drain port, bound to 127.0.0.1 only: GET /drain (stop admitting, leave the registry,
  answer once every stream has finished). Only a process inside the pod can drain the
  worker: the preStop hook runs `splitserve drain` there. Anything that may scrape a
  worker must not be able to take it out of service.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

DRAIN_PORT = 8083


def admin_app(worker) -> web.Application:
    async def health(request):
        ok = bool(worker.address) and not worker.draining
        status = "ok" if ok else ("draining" if worker.draining else "starting")
        body = {"status": status, "worker_id": worker.worker_id, "streams": len(worker.streams)}
        if hasattr(worker, "engine"):  # once the model is loaded
            body["kv"] = worker.kv_state()
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(request):
        return web.Response(body=generate_latest(worker.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def drain_app(worker, drain_timeout: float) -> web.Application:
    async def drain(request):
        done = await worker.drain(drain_timeout)
        return web.json_response({"drained": done, "streams_left": len(worker.streams)},
                                 status=200 if done else 504)

    app = web.Application()
    app.router.add_get("/drain", drain)
    return app


async def start_admin(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; port 0 picks a free one. Returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no getter


def main(argv: list[str] | None = None) -> int:
    """`splitserve drain`: ask the decode worker in this pod to drain; exit 0 once drained."""
    ap = argparse.ArgumentParser(prog="splitserve drain", description=main.__doc__)
    ap.add_argument("--port", type=int, default=DRAIN_PORT, help="the worker's loopback drain port")
    ap.add_argument("--timeout", type=float, default=660.0, help="seconds to wait for the answer")
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}/drain"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"splitserve drain: {url} answered {exc.code}: {exc.read().decode()}", file=sys.stderr)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        print(f"splitserve drain: cannot reach {url}: {exc} (is the decode worker running here?)",
              file=sys.stderr)
    return 1
