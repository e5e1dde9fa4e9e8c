"""One prefill worker as a plain process, without Ray (cluster mode with Redis).

`python -m splitserve.prefill_worker.main --redis-url redis://... --port 50051`
Kubernetes runs prefill workers through `splitserve prefill-pool` (Ray actors); this
entry point is for machines without Ray and for fault-injection tests, where a test
kills the worker's process.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

from splitserve.core.cli_types import OneLineParser
from splitserve.core.cpus import available_cpus, threads_per_worker
from splitserve.core.machine_limits import kv_sizes_problem
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
from splitserve.logs import configure_logging
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from splitserve.security.links import add_security_args, security_from_args
from splitserve.worker_base.config import ENGINE_LOOPS, add_worker_health_args
from splitserve.worker_base.process import run_worker_process


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="splitserve prefill-worker", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--metrics-port", type=int, default=PREFILL_ADMIN_PORT, help="/metrics and /health (with block accounting)")
    ap.add_argument("--advertise-host", default=os.environ.get("POD_IP"))
    ap.add_argument("--worker-id", default=os.environ.get("POD_NAME") or f"prefill-{socket.gethostname()}")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="local")
    add_worker_health_args(ap)
    add_security_args(ap)
    add_tracing_args(ap)
    return ap


def main(argv: list[str] | None = None, worker_class: type[PrefillWorker] = PrefillWorker) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    problem = (compatibility_problem(args, prefill_role=True) or tensor_parallel_problem(args) or kv_offload_problem(args)
               or kv_sizes_problem(args) or lora_problem(args) or async_scheduling_problem(args))
    if problem:
        print(f"splitserve prefill-worker: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.torch_threads or threads_per_worker(available_cpus()))
    model, served = resolve_model(args)
    config = PrefillWorkerConfig(engine_config_from_args(args, model, served), worker_id=args.worker_id,
                                 host=args.host, port=args.port, advertise_host=args.advertise_host,
                                 bus_url=args.redis_url, cluster=args.cluster, admin_port=args.metrics_port,
                                 security=security_from_args(args), engine_stall_timeout_s=args.engine_stall_timeout,
                                 engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
                                 engine_process=ENGINE_LOOPS[args.engine_loop],
                                tracing=tracing_config_from_args(args, "splitserve prefill-worker"))
    worker = worker_class(config)
    return run_worker_process(worker, lambda: f"splitserve prefill-worker: {worker.worker_id} serving gRPC on "
                                              f"{worker.address}, metrics {worker.admin_url}")


if __name__ == "__main__":
    sys.exit(main())
