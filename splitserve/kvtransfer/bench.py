"""`splitserve bench kvtransfer`: KV transfer throughput against a raw TCP socket.

Two processes on one host: this one is the prefill side (a KV pool with random
blocks, a KVSender), a spawned child is the decode side (a KV pool, a KVReceiver, and
a plain TCP socket). Each round copies the same blocks twice: over the raw socket
(sendall of each block straight from the pool, recv_into straight into the
destination blocks: the best a single TCP stream does here) and through the chosen
backend (which also checksums, acknowledges and manages leases). Destination blocks
are a shuffled set, as in a live pool. The receiver's bytes are checked every round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import xxhash

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


def _receiver_main(conn, config: KVTransferConfig, num_blocks: int) -> None:
    """Decode side: serves KVReceiver and a raw socket, driven by commands on `conn`."""
    from splitserve.kvtransfer.receiver import KVReceiver

    pool = KVCachePool(BENCH_SPEC, num_blocks)
    receiver = KVReceiver(pool, config, worker_id="bench-decode")
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((receiver.start(), listener.getsockname()[1]))
    raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    futures = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":
            request_id, dest = args
            futures[request_id] = (receiver.expect(request_id, dest, [], lambda ids: None, timeout=120), dest)
            conn.send("ok")
        elif cmd == "outcome":
            fut, dest = futures.pop(args[0])
            result = fut.result(timeout=120)
            conn.send((result.ok, result.reason, result.detail, _digest(pool, dest)))
        elif cmd == "raw":
            (dest,) = args
            for view in host_regions(pool, dest, RegionLayout.of(pool)):  # writable views of the pool
                got = 0
                while got < len(view):
                    got += raw.recv_into(view[got:])
            raw.sendall(b"k")
            conn.send(_digest(pool, dest))
        else:
            break
    receiver.stop()
    raw.close()
    listener.close()


def _raw_round(sock: socket.socket, conn, src: KVCachePool, src_ids: list[int], dest: list[int]) -> tuple[float, int]:
    conn.send(("raw", dest))
    start = time.perf_counter()
    for view in host_regions(src, src_ids, RegionLayout.of(src)):
        sock.sendall(view)
    if sock.recv(1) != b"k":
        raise RuntimeError("raw-socket receiver did not acknowledge")
    seconds = time.perf_counter() - start
    return seconds, conn.recv()


def _backend_round(sender, conn, address: str, src: KVCachePool, src_ids: list[int], dest: list[int],
                   request_id: str) -> tuple[float, int]:
    conn.send(("expect", request_id, dest))
    conn.recv()
    start = time.perf_counter()
    sender.push(request_id, address, src, src_ids, dest, [], timeout=120)
    seconds = time.perf_counter() - start
    conn.send(("outcome", request_id))
    ok, reason, detail, digest = conn.recv()
    if not ok:
        raise RuntimeError(f"receiver reported {reason}: {detail}")
    return seconds, digest


def run(backend: str, size_mb: int, repeat: int, config: KVTransferConfig) -> dict:
    from splitserve.kvtransfer.sender import create_sender

    n = max(1, (size_mb << 20) // BENCH_SPEC.block_nbytes)
    nbytes = n * BENCH_SPEC.block_nbytes
    src = KVCachePool(BENCH_SPEC, n)
    src.data.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    src_ids = list(range(n))
    expected = _digest(src, src_ids)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(child_conn, config, n + 8), daemon=True)
    child.start()
    raw_s, backend_s = [], []
    try:
        address, raw_port = conn.recv()
        sock = socket.create_connection(("127.0.0.1", raw_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender = create_sender(backend, config)
        rng = random.Random(0)
        # Warm-up: connections, Describe, Mooncake handshake and registration.
        _backend_round(sender, conn, address, src, src_ids[:1], [0], "warmup")
        _raw_round(sock, conn, src, src_ids[:1], [0])
        for r in range(repeat):
            dest = rng.sample(range(n + 8), n)
            seconds, digest = _raw_round(sock, conn, src, src_ids, dest)
            if digest != expected:
                raise RuntimeError("raw-socket round delivered different bytes")
            raw_s.append(seconds)
            seconds, digest = _backend_round(sender, conn, address, src, src_ids, dest, f"bench-{r}")
            if digest != expected:
                raise RuntimeError(f"{backend} round delivered different bytes")
            backend_s.append(seconds)
        sender.close()
        sock.close()
        conn.send(("stop",))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    raw_gbps = [nbytes / s / 1e9 for s in raw_s]
    backend_gbps = [nbytes / s / 1e9 for s in backend_s]
    ratio = statistics.median(backend_gbps) / statistics.median(raw_gbps)
    label = backend if backend == "grpc" else f"mooncake-{config.mooncake_protocol}"
    return {
        "backend": label, "size_mb": nbytes / (1 << 20), "blocks": n, "block_bytes": BENCH_SPEC.block_nbytes,
        "chunk_mb": config.chunk_bytes / (1 << 20), "repeat": repeat,
        "raw_gbps": raw_gbps, "backend_gbps": backend_gbps,
        "raw_gbps_median": statistics.median(raw_gbps), "backend_gbps_median": statistics.median(backend_gbps),
        "ratio": ratio, "target_ratio": TARGETS[backend], "target_met": ratio >= TARGETS[backend],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench kvtransfer", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=sorted(TARGETS), default="grpc")
    parser.add_argument("--size-mb", type=int, default=64, help="KV bytes to move per round, in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; GB/s are medians over rounds")
    parser.add_argument("--chunk-mb", type=float, default=KVTransferConfig.chunk_bytes / (1 << 20),
                        help="grpc message size in MiB")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp", help="mooncake transport")
    parser.add_argument("--device", default="", help="mooncake RDMA device name, e.g. mlx5_0")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.repeat < 1:
        parser.error("--size-mb and --repeat must be at least 1")
    config = KVTransferConfig(backend=args.backend, chunk_bytes=int(args.chunk_mb * (1 << 20)),
                              mooncake_protocol=args.protocol, mooncake_device=args.device, timeout_s=120)
    result = run(args.backend, args.size_mb, args.repeat, config)
    print(f"kvtransfer {result['backend']}: {result['size_mb']:.0f} MiB in {result['blocks']} blocks of "
          f"{result['block_bytes'] >> 10} KiB, median of {args.repeat}")
    print(f"  {'raw socket':<14}{result['raw_gbps_median']:.3f} GB/s")
    print(f"  {result['backend']:<14}{result['backend_gbps_median']:.3f} GB/s")
    print(f"  {'ratio':<14}{result['ratio']:.2f} (target {result['target_ratio']:.2f}, "
          f"{'met' if result['target_met'] else 'NOT met'})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
