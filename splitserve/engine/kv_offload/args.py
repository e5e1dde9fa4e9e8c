"""The offload tiers' command-line flags (added to every engine's flags by engine/args.py)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

GIB = 2**30


def non_negative_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size in GiB must be finite and >= 0")
    return value


def add_kv_offload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--kv-offload-gib", type=non_negative_gib, default=0.0,
                   help="host-memory KV tier per worker, under the device KV pool: prefix blocks evicted from "
                        "the pool are kept here and loaded back instead of recomputed (0: off; "
                        "docs/architecture.md, KV offload tiers)")
    g.add_argument("--kv-offload-dir", help="disk KV tier: a directory for KV block files (one checksummed "
                                            "file per block; each worker uses its own subdirectory). Needs "
                                            "--kv-offload-dir-gib")
    g.add_argument("--kv-offload-dir-gib", type=non_negative_gib, default=0.0,
                   help="size of the disk KV tier per worker (with --kv-offload-dir)")


def kv_offload_problem(args: argparse.Namespace) -> str | None:
    """Why the offload flags cannot be served (one line), or None; checked before any process
    starts (which features the tiers combine with is engine/args.py compatibility_problem's)."""
    directory, size = getattr(args, "kv_offload_dir", None), getattr(args, "kv_offload_dir_gib", 0.0)
    if (directory is None) != (size == 0):
        return "--kv-offload-dir and --kv-offload-dir-gib go together: the disk tier needs a directory and a size"
    return directory_problem(directory) if directory is not None else None


def directory_problem(directory: str) -> str | None:
    """Why the disk tier cannot write under `directory` (made if missing), or None: tried for real
    (a file created and removed), since permission bits say nothing of a read-only mount or of
    root, and a worker finding out later would only switch its tier off."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or str(exc)
        return (f"--kv-offload-dir {directory}: cannot write there ({why}): give the workers' user a writable "
                "directory of its own (mode 0700; docs/operations.md, KV offload tiers)")
    return None


def kv_offload_fields(args: argparse.Namespace) -> dict:
    """EngineConfig fields of the offload flags."""
    return dict(kv_offload_bytes=int(getattr(args, "kv_offload_gib", 0.0) * GIB),
                kv_offload_dir=getattr(args, "kv_offload_dir", None),
                kv_offload_dir_bytes=int(getattr(args, "kv_offload_dir_gib", 0.0) * GIB))
