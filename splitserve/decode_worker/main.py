"""`splitserve decode-worker`: one decode worker (cluster mode, a Kubernetes Deployment).

Admin HTTP on --admin-port: /health, /metrics; /drain on --drain-port, loopback only
(`splitserve drain` from inside the pod; see decode_worker/admin.py).
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
from splitserve.core.ports import ADMIN_PORT, DECODE_GRPC_PORT, DRAIN_PORT
from splitserve.core.tracing_config import add_tracing_args, tracing_config_from_args
from splitserve.decode_worker.prefill_timeout import add_prefill_timeout_arg
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
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
from splitserve.logs import configure_logging
from splitserve.security.links import add_security_args, security_from_args
from splitserve.worker_base.config import ENGINE_LOOPS, add_worker_health_args
from splitserve.worker_base.process import run_worker_process


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="splitserve decode-worker", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=DECODE_GRPC_PORT)
    ap.add_argument("--admin-port", type=int, default=ADMIN_PORT)
    ap.add_argument("--advertise-host", default=os.environ.get("POD_IP"),
                    help="address other components dial (default: $POD_IP, else --host)")
    ap.add_argument("--worker-id", default=os.environ.get("POD_NAME") or f"decode-{socket.gethostname()}")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    ap.add_argument("--kv-protocol", choices=["tcp", "rdma"], default="tcp", help="mooncake transport")
    ap.add_argument("--rdma-device", help="RDMA device for mooncake, e.g. mlx5_0")
    ap.add_argument("--drain-port", type=int, default=DRAIN_PORT, help="loopback-only port of /drain")
    ap.add_argument("--drain-timeout", type=float, default=600.0)
    add_prefill_timeout_arg(ap)
    add_worker_health_args(ap)
    add_security_args(ap)
    add_tracing_args(ap)
    args = ap.parse_args(argv)
    configure_logging()
    torch.set_num_threads(args.torch_threads or threads_per_worker(available_cpus()))
    problem = (compatibility_problem(args) or tensor_parallel_problem(args) or speculative_problem(args)
               or kv_offload_problem(args) or kv_sizes_problem(args) or lora_problem(args)
               or async_scheduling_problem(args))
    if problem:  # one line, before the model loads
        print(f"splitserve decode-worker: {problem}", file=sys.stderr)
        return 2
    model, served = resolve_model(args)
    advertise = args.advertise_host or (None if args.host == "0.0.0.0" else args.host) or socket.gethostname()
    config = DecodeWorkerConfig(decode_worker_engine(engine_config_from_args(args, model, served), args),
                                worker_id=args.worker_id,
                                host=args.host, port=args.port, advertise_host=advertise, bus_url=args.redis_url,
                                cluster=args.cluster, kv_backend=args.kv_backend, kv_protocol=args.kv_protocol,
                                rdma_device=args.rdma_device, admin_port=args.admin_port,
                                drain_port=args.drain_port, drain_timeout_s=args.drain_timeout,
                                prefill_timeout_s=args.prefill_timeout,
                                security=security_from_args(args), engine_stall_timeout_s=args.engine_stall_timeout,
                                 engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
                                engine_process=ENGINE_LOOPS[args.engine_loop],
                                tracing=tracing_config_from_args(args, "splitserve decode-worker"))
    worker = DecodeWorker(config)
    return run_worker_process(
        worker, lambda: f"splitserve decode-worker: {worker.worker_id} serving gRPC on {worker.address}, KV receiver "
                        f"{worker.kv_address or 'none'}, admin {worker.admin_url or '(off)'}",
        before_stop=lambda: worker.drain(args.drain_timeout))
