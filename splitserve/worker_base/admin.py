"""A worker's admin HTTP port (scraped; reachable by what the NetworkPolicy lets in):

- GET /health: readiness. 200 only when the worker serves requests (started, engine
  alive and not stalled, its gRPC server answering, not draining); 503 otherwise,
  with the reason. Block accounting under "kv", engine state under "engine".
- GET /livez: liveness. 503 only when the worker is broken for good or stuck (engine
  dead or stalled, gRPC server not answering), so Kubernetes restarts it; a worker
  that is loading its model or draining is alive.
- GET /metrics.
Nothing here changes the worker: draining is on a loopback-only port (decode_worker/admin.py).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

ALIVE_STATES = ("ok", "starting", "draining")


def admin_app(worker) -> web.Application:
    async def state() -> tuple[bool, dict]:
        ok, status, detail = await worker.health()
        body = {"status": status, "worker_id": worker.worker_id, "role": worker.role}
        if detail:
            body["detail"] = detail
        if worker.engine is not None:  # once the model is loaded
            engine = worker.engine
            body["engine"] = {"alive": engine.alive, "steps": engine.steps, "step_failures": engine.step_failures}
            if hasattr(engine, "heartbeat_age_s"):  # an engine process: which one, and when it last answered
                body["engine"].update(pid=engine.pid, heartbeat_age_s=round(engine.heartbeat_age_s(), 3))
            body["kv"] = worker.kv_state()
            body.update(worker.admin_extras())
        return ok, body

    async def health(request):
        ok, body = await state()
        return web.json_response(body, status=200 if ok else 503)

    async def livez(request):
        _, body = await state()
        return web.json_response(body, status=200 if body["status"] in ALIVE_STATES else 503)

    async def metrics(request):
        if worker.engine is not None and not worker.failed:
            # the engine's counters as of this scrape, not as of the last load report (every
            # 0.5 s): a burst that ended since would not show yet
            worker.load_report()
        return web.Response(body=generate_latest(worker.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/livez", livez)
    app.router.add_get("/metrics", metrics)
    return app


async def start_admin(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; port 0 picks a free one. Returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no getter
