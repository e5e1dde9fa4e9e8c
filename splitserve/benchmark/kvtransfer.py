"""`splitserve bench kvtransfer`: KV transfer throughput against a raw TCP socket.

Two processes on one host: this one is the prefill side (a KV pool with random
blocks, a KVSender), a spawned child is the decode side (a KV pool, a KVReceiver, and
a plain TCP socket). Each round moves the same blocks three ways, in shuffled order:
  raw      sendall of each block straight from the pool, recv_into straight into the
           destination blocks: the best a single TCP stream does here;
  bare     the backend's transport alone (grpcio stream into the pool / Mooncake
           batch of one-sided writes), no checksums, lease or protocol: what the
           library allows;
  backend  the real push (checksums, lease, acknowledgement included).
Destination blocks are a shuffled set, as in a live pool; every round's bytes are
checked at the receiver. With two or more CPUs the two processes are pinned to
different ones (--no-pin to disable): prefill and decode never share CPUs in a
deployment, and unpinned, the scheduler's placement of the two loopback processes
moved the raw socket alone between 1.6 and 5.5 GB/s on the 2-core dev VM.
The ratio is the median over rounds of backend / raw of the same round, which
cancels drift between rounds; the ratio of medians is reported too. Each side's CPU
seconds per GB moved (all its threads, checks excluded) say which end is the ceiling.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import xxhash

from splitserve.benchmark.kvtransfer_bare import BareSink, bare_grpc_push, bare_mooncake_push
from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.kvtransfer.config import KVTransferConfig
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions

# A Llama-3-8B-shaped block (32 layers, 8 KV heads of 128, 16 tokens, bf16): 2 MiB.
BENCH_SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
TARGETS = {"grpc": 0.5, "mooncake": 0.7}


def _digest(pool: KVCachePool, block_ids: list[int]) -> int:
    h = xxhash.xxh3_64()
    for view in host_regions(pool, block_ids, RegionLayout.of(pool)):
        h.update(view)
    return h.intdigest()


def _cpu_seconds() -> float:
    """CPU time of this whole process, every thread (gone ones too) included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpus(pin: bool) -> tuple[int, int] | None:
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if pin and len(cpus) >= 2 else None


def _receiver_main(conn, config: KVTransferConfig, num_blocks: int, cpu: int | None) -> None:
    """Decode side: serves KVReceiver, a bare grpc sink and a raw socket, driven over `conn`."""
    from splitserve.kvtransfer.receiver import KVReceiver

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # before any thread starts: they all inherit it
    pool = KVCachePool(BENCH_SPEC, num_blocks)
    receiver = KVReceiver(pool, config, worker_id="bench-decode")
    sink = BareSink(pool, config)
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((receiver.start(), sink.start(), listener.getsockname()[1]))
    raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    futures = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "cpu":
            conn.send(_cpu_seconds())
        elif cmd == "expect":
            request_id, dest = args
            futures[request_id] = (receiver.expect(request_id, dest, [], lambda ids: None, timeout=120), dest)
            conn.send("ok")
        elif cmd == "outcome":
            fut, dest = futures.pop(args[0])
            result = fut.result(timeout=120)
            cpu_used = _cpu_seconds()  # before our own check of the bytes
            conn.send((result.ok, result.reason, result.detail, _digest(pool, dest), cpu_used))
        elif cmd == "digest":
            cpu_used = _cpu_seconds()
            conn.send((_digest(pool, args[0]), cpu_used))
        elif cmd == "raw":
            (dest,) = args
            for view in host_regions(pool, dest, RegionLayout.of(pool)):  # writable views of the pool
                got = 0
                while got < len(view):
                    got += raw.recv_into(view[got:])
            raw.sendall(b"k")
            cpu_used = _cpu_seconds()
            conn.send((_digest(pool, dest), cpu_used))
        else:
            break
    receiver.stop()
    sink.stop()
    raw.close()
    listener.close()


# Each round returns (seconds, digest of what arrived, receiver CPU seconds once it had arrived).
Round = tuple[float, int, float]


def _raw_round(sock: socket.socket, conn, src: KVCachePool, src_ids: list[int], dest: list[int]) -> Round:
    conn.send(("raw", dest))
    start = time.perf_counter()
    for view in host_regions(src, src_ids, RegionLayout.of(src)):
        sock.sendall(view)
    if sock.recv(1) != b"k":
        raise RuntimeError("raw-socket receiver did not acknowledge")
    seconds = time.perf_counter() - start
    return (seconds, *conn.recv())


def _bare_round(push, conn, src: KVCachePool, src_ids: list[int], dest: list[int]) -> Round:
    start = time.perf_counter()
    push(src, src_ids, dest)
    seconds = time.perf_counter() - start
    conn.send(("digest", dest))
    return (seconds, *conn.recv())


def _backend_round(sender, conn, address: str, src: KVCachePool, src_ids: list[int], dest: list[int],
                   request_id: str) -> Round:
    conn.send(("expect", request_id, dest))
    conn.recv()
    start = time.perf_counter()
    sender.push(request_id, address, src, src_ids, dest, [], timeout=120)
    seconds = time.perf_counter() - start
    conn.send(("outcome", request_id))
    ok, reason, detail, digest, cpu = conn.recv()
    if not ok:
        raise RuntimeError(f"receiver reported {reason}: {detail}")
    return seconds, digest, cpu


def run(backend: str, size_mb: int, repeat: int, config: KVTransferConfig, pin: bool = True) -> dict:
    from splitserve.kvtransfer.sender import create_sender

    n = max(1, (size_mb << 20) // BENCH_SPEC.block_nbytes)
    nbytes = n * BENCH_SPEC.block_nbytes
    cpus = _cpus(pin)
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})  # this thread, and every thread started after it
    src = KVCachePool(BENCH_SPEC, n)
    src.data.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    src_ids = list(range(n))
    expected = _digest(src, src_ids)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, daemon=True,
                        args=(child_conn, config, n + 8, cpus[1] if cpus else None))
    child.start()
    gbps: dict[str, list[float]] = {"raw": [], "bare": [], "backend": []}
    cpu_per_gb: dict[str, list[tuple[float, float]]] = {k: [] for k in gbps}  # (sender, receiver)
    try:
        address, sink_address, raw_port = conn.recv()
        sock = socket.create_connection(("127.0.0.1", raw_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender = create_sender(backend, config)
        if backend == "grpc":
            bare = bare_grpc_push(sink_address, config)
        else:
            bare = bare_mooncake_push(sender, address)
        rounds = {
            "raw": lambda ids, dest, tag: _raw_round(sock, conn, src, ids, dest),
            "bare": lambda ids, dest, tag: _bare_round(bare, conn, src, ids, dest),
            "backend": lambda ids, dest, tag: _backend_round(sender, conn, address, src, ids, dest, tag),
        }
        for step in rounds.values():  # warm-up: connections, Describe, Mooncake handshake
            step(src_ids[:1], [0], "warmup")
        rng = random.Random(0)
        for r in range(repeat):
            dest = rng.sample(range(n + 8), n)
            order = list(rounds)
            rng.shuffle(order)
            for name in order:
                conn.send(("cpu",))
                receiver_cpu, sender_cpu = conn.recv(), _cpu_seconds()
                seconds, digest, receiver_end = rounds[name](src_ids, dest, f"bench-{r}")
                sender_end = _cpu_seconds()  # includes the sender's side of the pipe chat: tiny
                if digest != expected:
                    raise RuntimeError(f"{name} round delivered different bytes")
                gbps[name].append(nbytes / seconds / 1e9)
                cpu_per_gb[name].append(((sender_end - sender_cpu) / nbytes * 1e9, (receiver_end - receiver_cpu) / nbytes * 1e9))
        sender.close()
        sock.close()
        conn.send(("stop",))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    return summarize(backend, config, nbytes, n, repeat, gbps, cpus, cpu_per_gb)


def summarize(backend: str, config: KVTransferConfig, nbytes: int, blocks: int, repeat: int,
              gbps: dict[str, list[float]], cpus: tuple[int, int] | None,
              cpu_per_gb: dict[str, list[tuple[float, float]]]) -> dict:
    """The JSON record of a run: per-round GB/s, medians, the paired ratios, and each
    side's median CPU seconds per GB moved."""
    med = {k: statistics.median(v) for k, v in gbps.items()}
    cpu_medians = {k: {"sender": statistics.median(s for s, _ in v), "receiver": statistics.median(r for _, r in v)}
                   for k, v in cpu_per_gb.items()}
    paired = statistics.median(b / r for b, r in zip(gbps["backend"], gbps["raw"], strict=True))
    paired_bare = statistics.median(b / r for b, r in zip(gbps["bare"], gbps["raw"], strict=True))
    label = backend if backend == "grpc" else f"mooncake-{config.mooncake_protocol}"
    return {
        "backend": label, "size_mb": nbytes / (1 << 20), "blocks": blocks, "block_bytes": BENCH_SPEC.block_nbytes,
        "chunk_mb": config.chunk_bytes / (1 << 20), "repeat": repeat, "pinned_cpus": list(cpus) if cpus else None,
        "raw_gbps": gbps["raw"], "bare_gbps": gbps["bare"], "backend_gbps": gbps["backend"],
        "raw_gbps_median": med["raw"], "bare_gbps_median": med["bare"], "backend_gbps_median": med["backend"],
        "ratio": paired, "ratio_of_medians": med["backend"] / med["raw"], "bare_ratio": paired_bare,
        "target_ratio": TARGETS[backend], "target_met": paired >= TARGETS[backend],
        "cpu_seconds_per_gb": cpu_medians,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench kvtransfer", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=sorted(TARGETS), default="grpc")
    parser.add_argument("--size-mb", type=int, default=64, help="KV bytes to move per round, in MiB")
    parser.add_argument("--repeat", type=int, default=7, help="rounds; GB/s and ratios are medians over rounds")
    parser.add_argument("--chunk-mb", type=float, default=KVTransferConfig.chunk_bytes / (1 << 20),
                        help="grpc message size in MiB")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp", help="mooncake transport")
    parser.add_argument("--device", default="", help="mooncake RDMA device name, e.g. mlx5_0")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the two processes to separate CPUs")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.repeat < 1:
        parser.error("--size-mb and --repeat must be at least 1")
    config = KVTransferConfig(backend=args.backend, chunk_bytes=int(args.chunk_mb * (1 << 20)),
                              mooncake_protocol=args.protocol, mooncake_device=args.device, timeout_s=120)
    result = run(args.backend, args.size_mb, args.repeat, config, pin=not args.no_pin)
    pinned = f"pinned to CPUs {result['pinned_cpus']}" if result["pinned_cpus"] else "not pinned"
    print(f"kvtransfer {result['backend']}: {result['size_mb']:.0f} MiB in {result['blocks']} blocks of "
          f"{result['block_bytes'] >> 10} KiB, {args.repeat} rounds, {pinned}")
    cpu = {k: f"  CPU s/GB sender {v['sender']:.2f} receiver {v['receiver']:.2f}"
           for k, v in result["cpu_seconds_per_gb"].items()}
    print(f"  {'raw socket':<16}{result['raw_gbps_median']:.3f} GB/s{' ' * 14}{cpu['raw']}")
    print(f"  {'bare transport':<16}{result['bare_gbps_median']:.3f} GB/s  (ratio {result['bare_ratio']:.2f}){cpu['bare']}")
    print(f"  {result['backend']:<16}{result['backend_gbps_median']:.3f} GB/s{' ' * 14}{cpu['backend']}")
    print(f"  {'ratio':<16}{result['ratio']:.2f} (median of per-round ratios; ratio of medians "
          f"{result['ratio_of_medians']:.2f}); target {result['target_ratio']:.2f}: "
          f"{'met' if result['target_met'] else 'NOT met'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
