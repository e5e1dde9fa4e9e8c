"""Decode worker admin HTTP: GET /health (200 ready, 503 starting or draining; block
accounting under "kv"),
GET /metrics, GET /drain (stop admitting, leave the registry, answer once every
stream has finished; the pod's preStop hook calls it before SIGTERM)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def admin_app(worker, drain_timeout: float) -> web.Application:
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

    async def drain(request):
        done = await worker.drain(drain_timeout)
        return web.json_response({"drained": done, "streams_left": len(worker.streams)},
                                 status=200 if done else 504)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/drain", drain)
    return app


async def start_admin(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; port 0 picks a free one. Returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no getter
