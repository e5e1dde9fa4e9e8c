"""`splitserve serve`: the whole cluster on one machine.

Starts a local Ray instance, hosts prefill and decode workers as Ray actors, and runs
the router (HTTP) in this process. The cluster bus is in-process by default (workers
reach it over a loopback gRPC bridge) or Redis with --redis-url. Ctrl-C stops all.

Every gRPC link (bus bridge, Generate, Prefill, KV receivers) requires a cluster token,
generated for this run unless one is given (--cluster-token-file, to attach more routers
or workers), so no other process on the machine can register a worker, push KV blocks or
read prompts; --tls-* adds mutual TLS on top.

(Just over 300 lines: the start-up order here, checks before Ray, Ray, workers, router,
supervision, reads top to bottom in one place; the pieces that stand alone, CPU plans, Ray
supervision, the banner, already live in their own modules.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import sys
import time

from splitserve import ray_watch
from splitserve.core.banner import serving_banner
from splitserve.core.checkpoint_check import cache_dir_problem
from splitserve.core.cli_types import OneLineParser, positive_int
from splitserve.core.cpus import (
    CpuPlan,
    available_cpus,
    pin_plan,
    pin_this_process,
    threads_per_worker,
)
from splitserve.core.machine_limits import kv_sizes_problem
from splitserve.core.model_dir import checkpoint_problem, demo_dir
from splitserve.core.tracing_config import tracing_config, tracing_config_from_args
from splitserve.decode_worker.prefill_timeout import add_prefill_timeout_arg
from splitserve.engine.args import (
    add_engine_args,
    async_scheduling_problem,
    compatibility_problem,
    decode_worker_engine,
    engine_config_from_args,
    resolve_model,
    speculative_problem,
    tensor_parallel_problem,
)
from splitserve.engine.kv_offload.args import kv_offload_problem
from splitserve.engine.lora.args import lora_problem
from splitserve.logs import configure_logging, keep_output_lines_whole
from splitserve.router.main import add_router_args, admin_key_from_args, bind_http, start_router
from splitserve.security.links import LinkSecurity, security_from_args
from splitserve.worker_base.config import ENGINE_LOOPS, add_worker_health_args

log = logging.getLogger("splitserve.serve")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="splitserve serve", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_router_args(ap)
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--redis-url", help="use Redis as the cluster bus (default: in-process)")
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    add_prefill_timeout_arg(ap)
    ap.add_argument("--cpus", type=positive_int, help="CPUs the workers' engines share (default: those this process may "
                    "use); each worker gets an equal share of torch threads unless --torch-threads is given")
    ap.add_argument("--no-cpu-pinning", action="store_true",
                    help="do not pin each CPU engine to cores of its own and the serving processes to the rest "
                         "(by default they are, where the CPUs allow it; docs/operations.md)")
    add_worker_health_args(ap)
    add_engine_args(ap)
    ap.add_argument("--log-level", default="INFO")
    return ap


def worker_threads(args: argparse.Namespace) -> int:
    """Torch threads per worker: --torch-threads, else an equal share of --cpus (all this
    process may use): no oversubscription, and the machine used (docs/operations.md)."""
    if args.torch_threads is not None:
        return args.torch_threads
    usable = available_cpus()
    if args.cpus is not None and args.cpus > usable:  # allowed (the user may know better), but said
        log.warning("--cpus %d is more than the %d CPU(s) this process may use: the workers' threads "
                    "will outnumber the cores and wait for each other", args.cpus, usable)
    cpus = usable if args.cpus is None else args.cpus
    return threads_per_worker(cpus, args.prefill_workers + args.decode_workers)


def cpu_plan(args: argparse.Namespace, engine_process: bool | None, threads: int,
             affinity: list[int] | None = None, usable: int | None = None) -> CpuPlan | None:
    """Pinning for CPU engines in processes of their own (core/cpus.py), or None: asked not
    to, a GPU or an engine on the worker's thread, --cpus other than this process's CPUs,
    or a cgroup quota below them (the CPUs are then shared with other tenants, not ours)."""
    if args.no_cpu_pinning or args.device != "cpu" or engine_process is False or not hasattr(os, "sched_setaffinity"):
        return None
    affinity = sorted(os.sched_getaffinity(0)) if affinity is None else affinity
    usable = available_cpus() if usable is None else usable
    if usable < len(affinity) or args.cpus not in (None, len(affinity)):
        return None
    return pin_plan(affinity, args.prefill_workers + args.decode_workers, threads)


def gpus_per_worker(device: str, workers: int, gpus: float, tp: int = 1) -> float:
    """The GPUs each worker actor asks Ray for. Ray hides every GPU from an actor that asks
    for none (CUDA_VISIBLE_DEVICES=""), so a CUDA worker must ask: one GPU each where there
    are enough, else an equal share with as few workers on one GPU as the count allows
    (one GPU, a prefill and a decode worker: half each). A tensor-parallel worker asks for
    one whole GPU per rank (its ranks take cuda:0..tp-1 of the ones Ray gives it), never a
    share. CPU workers ask for none. main() has already refused a device index (--device cuda:N)."""
    if device != "cuda":
        return 0.0
    whole = int(gpus)
    if whole < 1:
        raise ValueError("--device cuda, but Ray sees no GPU on this machine (nvidia-smi; CUDA_VISIBLE_DEVICES)")
    if tp > 1:
        if whole < workers * tp:
            raise ValueError(f"--tensor-parallel-size {tp}: {workers} workers need {workers * tp} GPUs (one per "
                             f"rank), Ray sees {whole}")
        return float(tp)
    return 1.0 if whole >= workers else 1.0 / -(-workers // whole)


def pinned_engine(engine, pinned):
    """The engine config of the next worker, with its CPUs where there is a plan."""
    cpus = next(pinned, ())
    return dataclasses.replace(engine, cpu_affinity=cpus) if cpus else engine


async def run(args: argparse.Namespace, stop: asyncio.Event) -> int:
    """Serve until `stop`; the exit code (1: a Ray process it depends on died, ray_watch.py)."""
    import ray

    from splitserve.cluster.remote_bus import BusServicer, open_bus
    from splitserve.core.model_dir import DEMO_LABEL
    from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from splitserve.metrics import Metrics
    from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
    from splitserve.worker_base.actor import WorkerActor

    if args.model is None:
        log.warning("no --model given: serving the %s", DEMO_LABEL)
    model, served = await asyncio.to_thread(resolve_model, args)
    engine = engine_config_from_args(args, model, served)
    given = security_from_args(args)  # --tls-*, and a cluster token if one was given
    # Without a given token, one fresh for this run: only the processes started here know it.
    security = given if given.token else LinkSecurity.generate(given.tls)
    metrics = Metrics()

    try:
        http = bind_http(args.host, args.port)
    except OSError as exc:
        raise SystemExit(f"splitserve serve: cannot listen on {args.host}:{args.port}: {exc.strerror} "
                         "(--host/--port)") from None
    threads = worker_threads(args)
    plan = cpu_plan(args, ENGINE_LOOPS[args.engine_loop], threads)
    if plan is not None:  # before Ray starts: its processes, our workers among them, inherit the set
        pin_this_process(plan.serving)
        print(f"splitserve: {plan.describe()}", flush=True)
    # Ray first: it forks its processes, which must not happen while this process runs gRPC
    # threads (grpc's fork handlers; Ray's dashboard head died with SIGABRT that way).
    keep_output_lines_whole()  # Ray prints its workers' lines from a thread of its own
    start_ray()
    for sig in (signal.SIGINT, signal.SIGTERM):  # ray.init installed its own SIGTERM handler (sys.exit)
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    descendants = ray_watch.Descendants()
    watcher = asyncio.get_running_loop().create_task(ray_watch.watch(descendants, stop))
    bus = open_bus(args.redis_url, "local")
    bridge = None
    worker_bus = args.redis_url
    if not args.redis_url:  # workers live in Ray processes: give them a loopback door to our bus
        from splitserve.proto.worker_pb2_grpc import add_BusServicer_to_server

        bridge = security.aio_server()
        add_BusServicer_to_server(BusServicer(bus, served, args.block_size, metrics), bridge)
        worker_bus = f"grpc://127.0.0.1:{security.add_port(bridge, '127.0.0.1:0')}"
        await bridge.start()
        print(f"splitserve: embedded bus bridge on {worker_bus} ({security.describe()})", flush=True)

    try:
        share = gpus_per_worker(engine.device, args.prefill_workers + args.decode_workers,
                                ray.cluster_resources().get("GPU", 0), args.tensor_parallel_size)
    except ValueError as exc:
        raise SystemExit(f"splitserve serve: {exc}") from None
    opts = {"num_cpus": 0, "num_gpus": share}  # CPUs shared; torch threads are set per worker
    actors = []
    pinned = iter(plan.engines if plan is not None else [])
    common = dict(bus_url=worker_bus, kv_backend=args.kv_backend, admin_port=0, security=security,
                  engine_stall_timeout_s=args.engine_stall_timeout,
                  engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
                  engine_process=ENGINE_LOOPS[args.engine_loop],
                  tracing=tracing_config_from_args(args, "splitserve serve"))
    for i in range(args.decode_workers):
        cfg = DecodeWorkerConfig(pinned_engine(decode_worker_engine(engine, args), pinned), worker_id=f"decode-{i}",
                                 prefill_timeout_s=args.prefill_timeout, **common)
        actors.append(WorkerActor.options(name=f"decode-{i}", **opts).remote(DecodeWorker, cfg, threads))
    for i in range(args.prefill_workers):
        cfg = PrefillWorkerConfig(pinned_engine(engine, pinned), worker_id=f"prefill-{i}", **common)
        actors.append(WorkerActor.options(name=f"prefill-{i}", **opts).remote(PrefillWorker, cfg, threads))

    runner = dispatcher = None
    try:
        for line in await asyncio.to_thread(ray.get, [a.describe.remote() for a in actors]):
            print(f"splitserve: {line}", flush=True)
        runner, dispatcher = await start_router(args, model, served, bus, args.block_size, args.max_model_len,
                                                security=security, metrics=metrics,
                                                expected_workers={"decode": args.decode_workers,
                                                                  "prefill": args.prefill_workers}, sock=http)
        expected = args.prefill_workers + args.decode_workers
        deadline = time.monotonic() + 60
        while len(dispatcher.sync.workers) < expected and time.monotonic() < deadline:
            await dispatcher.sync.refresh()
            await asyncio.sleep(0.1)
        details = (f"{args.prefill_workers} prefill + {args.decode_workers} decode workers, {threads} torch "
                   f"thread(s) each, bus: {args.redis_url or 'in-process'}, KV transfer: {args.kv_backend}")
        print(serving_banner("splitserve", served, args.host, args.port, details), flush=True)
        await stop.wait()
    finally:
        died = watcher.result() if watcher.done() else None
        watcher.cancel()
        if died is not None:  # one line an operator can act on; Ray's own lines say less
            print(f"splitserve serve: {died}; its workers can no longer be restarted, so serve stops everything "
                  "it started and exits 1 for its supervisor to start it again", file=sys.stderr, flush=True)
        print("splitserve: shutting down", flush=True)
        if runner is not None:
            await runner.cleanup()
            await dispatcher.stop()
        for a in actors if died is None else ():  # with Ray broken, stopping actors through it would hang
            try:
                await asyncio.to_thread(ray.get, a.stop.remote(), timeout=30)
            except ray.exceptions.RayActorError:  # already gone (the signal reached the whole group)
                pass
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.warning("worker actor did not stop cleanly: %s", exc)
        await asyncio.to_thread(descendants.note)
        if died is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(ray.shutdown), 15)
            except TimeoutError:
                log.warning("ray.shutdown did not return within 15 s; stopping Ray's processes directly")
        # With a broken node, ray.shutdown waits seconds on what is gone; its processes are
        # stopped directly instead, and main() leaves without Ray's exit handler.
        left = await asyncio.to_thread(descendants.stop_all, 5.0 if died is None else 1.0)
        if left and died is None:
            log.warning("stopped %d process(es) Ray left behind: %s", len(left), left)
        if bridge is not None:
            await bridge.stop(grace=1)
        await bus.close()
    return 1 if died is not None else 0


def start_ray() -> None:
    """A private Ray instance for this run: its node on loopback (docs/reliability.md lists
    the ports), no dashboard, its logs kept out of ours. Ray >= 2.59 authenticates every call
    to a local cluster with a token of its own (~/.ray/auth_token), so other users' processes
    cannot reach the actors either."""
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=True, configure_logging=False, _node_ip_address="127.0.0.1")


def main(argv: list[str] | None = None) -> int:
    # Before Ray is imported (it reads them then): worker log lines reach our stdout as
    # written, with no colour codes and no "[repeated 2x across cluster]" folding of lines
    # that differ only in ids and ports.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts its worker processes at nice 15 (made for background tasks). Ours are the
    # serving path: at 15 the bench client or any nice-0 process on the host takes their CPU
    # first (measured: TTFT at concurrency 1 fell from 33 to 10 ms at nice 0).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray's own RPC ports authenticate with a token. Ray's default writes one to
    # ~/.ray/auth_token, readable by every user of the host; ours is fresh per run and
    # lives only in the environment of this run's processes (readable by their user alone).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.prefill_workers < 0 or args.decode_workers < 1:
        print("splitserve serve: need --decode-workers >= 1 and --prefill-workers >= 0", file=sys.stderr)
        return 2
    if args.device.startswith("cuda:"):  # Ray numbers each worker's GPUs from 0: an index would mislead
        print(f"splitserve serve: --device {args.device}: serve gives each worker its GPU through Ray; pass "
              "--device cuda (CUDA_VISIBLE_DEVICES chooses which GPUs Ray may use)", file=sys.stderr)
        return 2
    if args.kv_backend == "mooncake":
        from splitserve.kvtransfer.mooncake_endpoint import gpu_memory_problem

        problem = gpu_memory_problem(args.device)
        if problem:
            print(f"splitserve serve: --kv-backend mooncake: {problem}", file=sys.stderr)
            return 2
    # checked before Ray or any process starts: one line, exit 2
    problem = checkpoint_problem(args.model, args.quantization) if args.model is not None else (
        None if (demo_dir() / "config.json").is_file() else cache_dir_problem(demo_dir()))
    problem = (problem or compatibility_problem(args) or tensor_parallel_problem(args) or speculative_problem(args)
               or kv_offload_problem(args) or kv_sizes_problem(args, args.prefill_workers + args.decode_workers)
               or lora_problem(args) or async_scheduling_problem(args))
    if problem:
        print(f"splitserve serve: {problem}", file=sys.stderr)
        return 2
    try:
        admin_key_from_args(args)  # the admin key must not be the API key: refused before Ray, not after
    except SystemExit as exc:
        print(f"splitserve serve: {exc}", file=sys.stderr)
        return 2
    try:
        tracing_config(args.otlp_traces_endpoint)
    except ValueError as exc:
        print(f"splitserve serve: {exc}", file=sys.stderr)
        return 2
    if args.redis_url and not args.redis_url.startswith(("redis://", "rediss://", "unix://")):
        print(f"splitserve serve: --redis-url {args.redis_url!r} must start with redis://", file=sys.stderr)
        return 2

    async def amain() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run(args, stop)

    code = asyncio.run(amain())
    if code:  # Ray's node broke (ray_watch.py): its at-exit shutdown would wait on the dead parts
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
