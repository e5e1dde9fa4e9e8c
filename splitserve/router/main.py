"""`splitserve router`: one router replica (cluster mode). Replicas are stateless
toward each other: each rebuilds its index from the workers' KV event streams in Redis."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket

from aiohttp import web

from splitserve.cluster.bus import ClusterBus
from splitserve.core import tracing
from splitserve.core.banner import serving_banner
from splitserve.core.cli_types import OneLineParser, positive_int
from splitserve.core.hashing import DEFAULT_BLOCK_SIZE
from splitserve.core.tracing_config import add_tracing_args, tracing_config_from_args
from splitserve.logs import configure_logging
from splitserve.metrics import Metrics
from splitserve.router.admission import AdmissionConfig
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.hold_at_zero import HoldConfig
from splitserve.router.http_limits import HTTPLimits
from splitserve.router.policy import PolicyConfig
from splitserve.router.responses_store import StoreConfig
from splitserve.router.server import RouterServer, ServerConfig
from splitserve.security.links import (
    LinkSecurity,
    add_security_args,
    read_secret_file,
    security_from_args,
)

log = logging.getLogger("splitserve.router")
LINGER_S = 2.0


def add_router_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--parse-control-tokens-in-content", action="store_true",
                    help="tokenize control-token text inside chat messages (e.g. '<|eot_id|>') as the control tokens "
                         "themselves, as transformers and vLLM do; by default it is tokenized as plain text, so a "
                         "message cannot end its turn or open another (docs/api.md)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default: $SPLITSERVE_API_KEY). Visible in `ps`: "
                         "prefer --api-key-file or the environment variable")
    ap.add_argument("--api-key-file", default=os.environ.get("SPLITSERVE_API_KEY_FILE"),
                    help="read the API key from this file (default: $SPLITSERVE_API_KEY_FILE)")
    ap.add_argument("--admin-api-key", default=os.environ.get("SPLITSERVE_ADMIN_API_KEY"),
                    help="the bearer key runtime LoRA load / unload need (with "
                         "SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING=1), distinct from --api-key, which does not grant "
                         "them (default: $SPLITSERVE_ADMIN_API_KEY). Visible in `ps`: prefer --admin-api-key-file")
    ap.add_argument("--admin-api-key-file", default=os.environ.get("SPLITSERVE_ADMIN_API_KEY_FILE"),
                    help="read the admin key from this file (default: $SPLITSERVE_ADMIN_API_KEY_FILE)")
    ap.add_argument("--disagg-min-uncached-tokens", type=int, default=256,
                    help="prompts with fewer uncached tokens are prefilled by the decode worker")
    ap.add_argument("--strict-disaggregation", action="store_true",
                    help="always send prompts above --disagg-min-uncached-tokens to a prefill worker, even when "
                         "the prefill pool is so backed up that the decode worker would finish the prompt first, "
                         "or the decode worker is idle (by default it then prefills locally; docs/architecture.md, "
                         "conditional disaggregation)")
    ap.add_argument("--max-migrations", type=int, default=2)
    ap.add_argument("--routing-seed", type=int, help="seed the router's tie-breaking (reproducible routing)")
    ap.add_argument("--routing-mode", choices=["prefix", "round-robin", "random"], default="prefix",
                    help="decode-worker choice; round-robin and random are baselines for benchmarks")
    ap.add_argument("--stream-interval", type=positive_int, default=1,
                    help="tokens per streamed chunk after the first (vLLM's --stream-interval): 1 sends every "
                         "token as it is generated; N sends N at a time, for less CPU per token; the first "
                         "token and the finish are never held back (default: %(default)s)")
    ap.add_argument("--max-queued-requests", type=int,
                    help="requests this router keeps in flight; beyond it: 429 with Retry-After (default: no bound)")
    ap.add_argument("--no-worker-wait", type=float, default=AdmissionConfig.no_worker_wait_s,
                    help="seconds a request waits for a healthy worker when there is none (one whose heartbeat was "
                         "late under load re-registering, a restart) before 503 no_workers; 0: answer 503 at once "
                         "(default: %(default)s)")
    ap.add_argument("--hold-requests-at-zero", type=int, default=HoldConfig.max_held, metavar="N",
                    help="with no decode worker registered (decode scaled to zero), hold up to N requests until one "
                         "registers instead of answering 503; the held count is published for the operator's "
                         "autoscaler to scale decode up from zero; 0: off (default: %(default)s)")
    ap.add_argument("--hold-timeout", type=float, default=HoldConfig.timeout_s, metavar="S",
                    help="seconds a request is held at zero before 503 with Retry-After (default: %(default)s)")
    ap.add_argument("--request-timeout", type=float,
                    help="seconds a request may take end to end; then it is aborted on every worker and the "
                         "client gets 504 (default: no deadline)")
    r = ap.add_argument_group("/v1/responses store (previous_response_id, GET /v1/responses/{id})")
    r.add_argument("--responses-store-max", type=int, default=StoreConfig.max_responses, metavar="N",
                   help="finished responses this router keeps in memory for previous_response_id; the least "
                        "recently used go first; per router process, not shared between replicas; 0: none "
                        "(default: %(default)s)")
    r.add_argument("--responses-store-mb", type=float, default=StoreConfig.max_mb, metavar="MB",
                   help="bound on the stored responses' size (their JSON, whole conversations) (default: %(default)s)")
    h = ap.add_argument_group("HTTP limits (clients are untrusted)")
    h.add_argument("--max-request-body-mb", type=float, default=HTTPLimits.max_body_mb,
                   help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    h.add_argument("--body-read-timeout", type=float, default=HTTPLimits.body_read_timeout_s,
                   help="seconds a client has to send a whole request body; then 408 (default: %(default)s)")
    h.add_argument("--http-idle-timeout", type=float, default=HTTPLimits.idle_timeout_s,
                   help="seconds a connection may stay open without a complete request: idle keep-alive or "
                        "headers still arriving; then it is closed (default: %(default)s)")
    add_security_args(ap)
    add_tracing_args(ap)


def api_key_from_args(args: argparse.Namespace) -> str | None:
    return read_secret_file(args.api_key_file, "--api-key-file") if args.api_key_file else args.api_key


def admin_key_from_args(args: argparse.Namespace) -> str | None:
    """The admin key; refused (one line) when it is the API key: every client would be an admin."""
    file = getattr(args, "admin_api_key_file", None)
    admin = read_secret_file(file, "--admin-api-key-file") if file else getattr(args, "admin_api_key", None)
    if admin and admin == api_key_from_args(args):
        raise SystemExit("--admin-api-key must differ from --api-key (the API key would then grant admin calls)")
    return admin


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP port, taken before anything slow starts: a port in use fails at once, with a
    clear message, and nothing started meanwhile (Ray picks random ports) can take it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)  # early clients wait in the backlog
    sock.setblocking(False)
    return sock


async def start_router(args: argparse.Namespace, model: str, served: str, bus: ClusterBus,
                       block_size: int, max_model_len: int | None, security: LinkSecurity | None = None,
                       metrics: Metrics | None = None,
                       expected_workers: dict[str, int] | None = None,
                       sock: socket.socket | None = None) -> tuple[web.AppRunner, Dispatcher]:
    """The router on `sock` if given (bound early by the caller), else on --host/--port."""
    tracing.configure(tracing_config_from_args(args, "splitserve router"), "splitserve-router")
    api_key, admin_key = api_key_from_args(args), admin_key_from_args(args)  # a bad one: exit before starting
    try:
        admission = AdmissionConfig(args.max_queued_requests, args.request_timeout, args.no_worker_wait)
        limits = HTTPLimits(args.max_request_body_mb, args.body_read_timeout, args.http_idle_timeout)
        hold = HoldConfig(args.hold_requests_at_zero, args.hold_timeout)
        store = StoreConfig(args.responses_store_max, args.responses_store_mb)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    dispatcher = Dispatcher(DispatchConfig(
        model_id=served, block_size=block_size, seed=args.routing_seed, max_migrations=args.max_migrations,
        mode=args.routing_mode, security=security or security_from_args(args), stream_interval=args.stream_interval,
        policy=PolicyConfig(disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
                            strict_disaggregation=args.strict_disaggregation)), bus, metrics)
    await dispatcher.start()
    gc.freeze()  # the index is long-lived: keep it out of collections (routing-latency spikes)
    server = RouterServer(ServerConfig(model, served, api_key=api_key, admin_api_key=admin_key,
                                       max_model_len=max_model_len,
                                       admission=admission, limits=limits, expected_workers=expected_workers or {},
                                       content_as_text=not args.parse_control_tokens_in_content, hold=hold,
                                       responses_store=store),
                          dispatcher)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels
    # the worker streams (the decode workers abort the request and free its blocks).
    # keepalive_timeout also bounds a connection whose request headers never complete;
    # lingering_time bounds how long the unread rest of a body is drained after an early
    # answer (401, 408, 413) before the connection closes (aiohttp's default: 10 s).
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True,
                           keepalive_timeout=limits.idle_timeout_s, lingering_time=LINGER_S)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, args.host, args.port)
    await site.start()
    return runner, dispatcher


def main(argv: list[str] | None = None) -> int:
    from splitserve.cluster.remote_bus import open_bus
    from splitserve.core.model_dir import resolve_model

    ap = OneLineParser(prog="splitserve router", description=__doc__)
    add_router_args(ap)
    ap.add_argument("--model", help="checkpoint directory (tokenizer, chat template, context length)")
    ap.add_argument("--served-model-name")
    ap.add_argument("--redis-url", required=True, help="the cluster bus, e.g. redis://redis:6379/0")
    ap.add_argument("--cluster", default="local", help="bus namespace: <namespace>.<InferenceDeployment name>")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--max-model-len", type=int)
    args = ap.parse_args(argv)
    configure_logging()
    model, served = resolve_model(args)

    async def amain() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        bus = open_bus(args.redis_url, args.cluster)
        runner, dispatcher = await start_router(args, model, served, bus, args.block_size, args.max_model_len)
        print(serving_banner("splitserve router", served, args.host, args.port,
                             f"bus {args.redis_url}, cluster {args.cluster}"), flush=True)
        await stop.wait()
        await runner.cleanup()
        await dispatcher.stop()
        await bus.close()

    asyncio.run(amain())
    return 0
