"""Messages on the cluster bus, encoded with msgpack.

Redis layout (prefix `splitserve:{cluster}:`, cluster = the InferenceDeployment or
`local`):
  workers:{worker_id}   msgpack WorkerInfo, TTL = heartbeat TTL, refreshed by heartbeat
  load:{worker_id}      msgpack LoadReport, TTL = heartbeat TTL
  kv:{worker_id}        Redis Stream of KV events, field `m` = msgpack KVEvent
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

import msgpack

Role = Literal["prefill", "decode"]


def key_prefix(cluster: str) -> str:
    return f"splitserve:{cluster}:"


@dataclass
class WorkerInfo:
    worker_id: str
    role: Role
    address: str  # host:port of the worker's gRPC server
    model: str
    block_size: int
    num_kv_blocks: int
    kv_backend: str = "grpc"
    kv_cache_dtype: str = ""  # the KV pool's element type ("bfloat16", "float8_e4m3fn", ...); "": not said
    started_at: float = field(default_factory=time.time)
    draining: bool = False  # finishing its streams: routers send it nothing new
    signature: str = ""  # HMAC with the cluster token (registration_auth.py); "": unsigned


@dataclass
class LoadReport:
    worker_id: str
    role: Role
    waiting: int  # requests queued, not yet scheduled
    running: int  # requests in the running batch
    kv_usage: float  # fraction of KV blocks in use, 0..1
    waiting_tokens: int = 0  # prompt tokens still to prefill (prefill workers' queue)
    timestamp: float = field(default_factory=time.time)
    loras: dict[str, int] = field(default_factory=dict)  # loaded LoRA adapter -> its block-hash salt
    resident_loras: list[str] = field(default_factory=list)  # those holding a slot now (routing prefers them)


@dataclass
class KVEvent:
    """Blocks stored in / removed from a worker's prefix cache.

    `event_id` increases by one per event per worker; a gap tells a router it
    missed events and must resync that worker. `parent` is the hash of the block
    before the first stored one (None at the start of a sequence).
    """

    worker_id: str
    event_id: int
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int]
    parent: int | None = None
    timestamp: float = field(default_factory=time.time)
    tier: str = "device"  # device (the KV pool), host or disk (its offload tiers, engine/kv_offload/)


def registration_refusal(info: WorkerInfo, model: str | None, block_size: int | None) -> tuple[str, str] | None:
    """(metric reason, message) when a worker must not be routed to by this router; None if it may."""
    if model is not None and info.model != model:
        return "model_mismatch", (f"worker {info.worker_id} ({info.role} at {info.address}) serves model "
                                  f"{info.model!r}, this router serves {model!r}: refused (start every component "
                                  "with the same --served-model-name)")
    if block_size is not None and info.block_size != block_size:
        return "block_size_mismatch", (f"worker {info.worker_id} ({info.role} at {info.address}) uses KV block size "
                                       f"{info.block_size}, this router {block_size}: refused (its prefix hashes "
                                       "would never match; start every component with the same --block-size)")
    return None


def kv_dtype_refusal(info: WorkerInfo, peers: Iterable[WorkerInfo]) -> tuple[str, str] | None:
    """(metric reason, message) when `info` keeps its KV cache in another dtype than an admitted
    peer: KV blocks move between workers byte for byte (prefill -> decode, migrations), so one
    fleet has one KV dtype; the peers already admitted fix it."""
    for peer in peers:
        if (peer.worker_id != info.worker_id and info.kv_cache_dtype and peer.kv_cache_dtype
                and peer.kv_cache_dtype != info.kv_cache_dtype):
            return "kv_cache_dtype_mismatch", (
                f"worker {info.worker_id} ({info.role} at {info.address}) keeps its KV cache in "
                f"{info.kv_cache_dtype}, worker {peer.worker_id} ({peer.role}) in {peer.kv_cache_dtype}: refused "
                "(KV blocks move between workers byte for byte; start every worker with the same "
                "--kv-cache-dtype and --dtype)")
    return None


def encode(message: WorkerInfo | LoadReport | KVEvent) -> bytes:
    return msgpack.packb(asdict(message), use_bin_type=True)


def decode(cls: type, payload: bytes):
    return cls(**msgpack.unpackb(payload, raw=False))
