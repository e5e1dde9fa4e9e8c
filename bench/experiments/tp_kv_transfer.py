"""What tensor parallelism costs the KV transfer (issue 32): a push over gRPC between two
pools in this process (sender and receiver threads, loopback), once between one-rank pools
(regions read in place, written by memcpy) and once between 2-rank ShardedKVPools (heads
gathered from both shards into one buffer on the way out, scattered to both on the way
in: engine/parallel/kv_shards.py), plus the gather and the scatter alone.

Blocks shaped as Llama-3-8B's in bf16 (32 layers, 8 KV heads of 128, 16 tokens: 2 MiB a
block), 32 blocks (a 512-token prompt, 64 MiB). Shared memory does not change a memcpy's
cost, so plain tensors stand in for the ranks' shared pools.

    python -m bench.experiments.tp_kv_transfer

Results go to bench/results/tp_kv_transfer.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from splitserve.kvtransfer.pool_io import RegionLayout, StreamWriter, host_regions
from splitserve.kvtransfer.sender import create_sender

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "tp_kv_transfer.json"
SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
POOL_BLOCKS, BLOCKS, REPEATS = 40, 32, 9


def one_rank_pool() -> KVCachePool:
    pool = KVCachePool(SPEC, POOL_BLOCKS)
    pool.data.normal_()
    return pool


def two_rank_pool() -> ShardedKVPool:
    half = SPEC.num_kv_heads // 2
    shards = [torch.randn(POOL_BLOCKS, *SPEC.block_shape[:3], half, SPEC.head_dim).to(SPEC.dtype) for _ in range(2)]
    return ShardedKVPool(SPEC, POOL_BLOCKS, shards, [(0, half), (half, half)])


def best_ms(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


def push_ms(src, dest) -> float:
    config = KVTransferConfig(backend="grpc", timeout_s=60)
    receiver = KVReceiver(dest, config, worker_id="bench")
    receiver.start()
    ids = list(range(BLOCKS))
    runs = []
    try:
        with create_sender("grpc", config) as sender:
            for i in range(REPEATS + 1):
                done = receiver.expect(f"r{i}", ids, [], lambda _ids: None)
                start = time.perf_counter()
                sender.push(f"r{i}", receiver.address, src, ids, ids, [])
                assert done.result(timeout=60).ok
                runs.append((time.perf_counter() - start) * 1000)
    finally:
        receiver.stop()
    return min(runs[1:])  # the first describes the receiver and opens the channel; min: the machine is shared


def main() -> None:
    torch.set_num_threads(1)
    mib = BLOCKS * SPEC.block_nbytes / 2**20
    plain, sharded = one_rank_pool(), two_rank_pool()
    layout = RegionLayout.of(plain)
    ids = list(range(BLOCKS))
    payload = sharded.read(ids).view(-1).view(torch.uint8).numpy()
    results = {
        "blocks": BLOCKS, "mib": mib, "block_shape": list(SPEC.block_shape), "dtype": "bfloat16",
        "read_one_rank_ms": best_ms(lambda: host_regions(plain, ids, layout)),
        "read_two_ranks_gather_ms": best_ms(lambda: host_regions(sharded, ids, layout)),
        "write_one_rank_ms": best_ms(lambda: StreamWriter(plain, ids, layout).write(0, memoryview(payload))),
        "write_two_ranks_scatter_ms": best_ms(lambda: StreamWriter(sharded, ids, layout).write(0, memoryview(payload))),
        "push_tp1_to_tp1_ms": push_ms(one_rank_pool(), one_rank_pool()),
        "push_tp2_to_tp2_ms": push_ms(two_rank_pool(), two_rank_pool()),
        "push_tp1_to_tp2_ms": push_ms(one_rank_pool(), two_rank_pool()),
    }
    results = {k: round(v, 2) if isinstance(v, float) else v for k, v in results.items()}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
