"""Draining a decode worker: GET /drain on a port bound to 127.0.0.1 only (stop admitting,
leave the registry, answer once every stream has finished), and `splitserve drain`, the
pod's preStop hook that calls it. Only a process inside the pod can drain the worker:
anything that may scrape its admin port (worker_base/admin.py) must not be able to take
it out of service.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from aiohttp import web

from splitserve.core.cli_types import OneLineParser
from splitserve.core.ports import DRAIN_PORT


def drain_app(worker, drain_timeout: float) -> web.Application:
    async def drain(request):
        done = await worker.drain(drain_timeout)
        return web.json_response({"drained": done, "streams_left": len(worker.streams)},
                                 status=200 if done else 504)

    app = web.Application()
    app.router.add_get("/drain", drain)
    return app


def main(argv: list[str] | None = None) -> int:
    """`splitserve drain`: ask the decode worker in this pod to drain; exit 0 once drained."""
    ap = OneLineParser(prog="splitserve drain", description=main.__doc__)
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
