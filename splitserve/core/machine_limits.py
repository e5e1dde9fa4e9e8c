"""What this machine can hold, checked against the flags before any process starts (issue 49).

`--kv-offload-gib 1e12` used to be accepted: Ray started, every worker tried to allocate its
host tier and died 11-30 s later with a hundred-line traceback. Here the host memory the
workers would take (each worker's host KV tier, and on a CPU device its KV pool, from
--kv-cache-memory or --num-kv-blocks blocks of the model's shape) is compared
with the memory available now, and each worker's disk tier with the free space of the
filesystem that holds --kv-offload-dir. No torch: /proc/meminfo, the cgroup's limit, statvfs.

Both are checks against what is free when the command starts, not reservations: another
process may still take the memory later. Weights and activations are not counted, so a size
that passes may still not fit; one that fails cannot.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

GIB = 2**30
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) is None


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory_bytes() -> int | None:
    """Memory this process's workers may still take: the kernel's MemAvailable, less where the
    container's cgroup limit leaves less; None where neither can be read (not Linux)."""
    candidates = [_meminfo_available()]
    for limit_file, usage_file in ((_CGROUP_V2 / "memory.max", _CGROUP_V2 / "memory.current"),
                                   (_CGROUP_V1 / "memory.limit_in_bytes", _CGROUP_V1 / "memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes "no limit" as ~2^63
            candidates.append(max(0, limit - usage))
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def free_disk_bytes(directory: str | os.PathLike) -> int | None:
    """Free bytes of the filesystem `directory` is (or will be created) on; None if unknown."""
    probe = Path(directory).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_pool_bytes(args: argparse.Namespace) -> float:
    """The KV pool of one worker, in bytes: --kv-cache-memory, or --num-kv-blocks blocks of the
    model's shape (engine/kv_cache.py KVCacheSpec: layers x 2 x block_size x KV heads x head_dim;
    KV heads replicated over ranks when there are fewer than ranks); 0 when that shape is unknown."""
    blocks = getattr(args, "num_kv_blocks", None)
    if blocks is None:
        return getattr(args, "kv_cache_memory", 0.0) * GIB
    from splitserve.core.model_dir import served_config

    cfg = served_config(getattr(args, "model", None))
    if cfg is None:
        return 0.0
    tp = max(1, getattr(args, "tensor_parallel_size", 1))
    kv_heads = max(1, cfg.num_kv_heads // tp) * tp
    elem = 1 if getattr(args, "kv_cache_dtype", "auto") != "auto" else _ELEMENT_BYTES.get(getattr(args, "dtype", ""), 4)
    return blocks * cfg.num_layers * 2 * getattr(args, "block_size", 16) * kv_heads * cfg.head_dim * elem


def kv_sizes_problem(args: argparse.Namespace, workers: int = 1, available: int | None = None,
                     free_disk: int | None = None) -> str | None:
    """Why the KV tier and pool sizes of `workers` workers on this machine cannot fit (one
    line), or None. `available` / `free_disk`: measured here unless given (tests)."""
    host_tier = getattr(args, "kv_offload_gib", 0.0) * GIB
    on_cpu = str(getattr(args, "device", "cpu")).startswith("cpu")
    pool = kv_pool_bytes(args) if on_cpu else 0.0  # a CPU engine's KV pool is host memory too
    wanted = workers * (host_tier + pool)
    if wanted > 0:
        available = available_memory_bytes() if available is None else available
        if available is not None and wanted > available:
            blocks = getattr(args, "num_kv_blocks", None)
            parts = ", ".join(f"{flag} {value:g}" for flag, value, on in (
                ("--kv-offload-gib", getattr(args, "kv_offload_gib", 0.0), host_tier),
                ("--num-kv-blocks" if blocks is not None else "--kv-cache-memory",
                 blocks if blocks is not None else getattr(args, "kv_cache_memory", 0.0), pool)) if on)
            return (f"{parts}: {workers} worker(s) would take {_gib(wanted)} of host memory, and this machine has "
                    f"{_gib(available)} available")
    directory, dir_gib = getattr(args, "kv_offload_dir", None), getattr(args, "kv_offload_dir_gib", 0.0)
    if directory and dir_gib:
        wanted = workers * dir_gib * GIB
        free_disk = free_disk_bytes(directory) if free_disk is None else free_disk
        if free_disk is not None and wanted > free_disk:
            return (f"--kv-offload-dir-gib {dir_gib:g}: {workers} worker(s) would write up to {_gib(wanted)} under "
                    f"{directory}, and its filesystem has {_gib(free_disk)} free")
    return None
