"""The disk tier: one file per KV block under a local directory, keyed by block hash.

File `<hash:016x>.kv` = a 40-byte header (magic, version, the pool layout's tag, the block
hash, the payload length, the payload's xxh3_64) followed by the block's bytes. Files are
written to a temporary name and renamed, so a name never points at half a write. A read
checks everything in the header against what is expected; a missing, short, foreign or
corrupt file is a miss (the caller recomputes), and the file is dropped.

Each tier owns a fresh subdirectory `kv-<pid>-<random>` of the configured directory and
holds an exclusive flock on its `lock` file while alive: several workers may share one
directory (an emptyDir), and a later tier removes the subdirectories of dead ones.
Thread-safe: the index is guarded by a lock, file I/O runs outside it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

MAGIC = b"SSKV"
VERSION = 1
HEADER = struct.Struct("<4sHHQQQQ")  # magic, version, reserved, layout tag, hash, payload length, xxh3_64


def encode_header(layout_tag: int, block_hash: int, payload: memoryview | bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, layout_tag, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload))


def check_file(blob: bytes, layout_tag: int, block_hash: int, block_nbytes: int) -> str | None:
    """Why a file's bytes are not the block expected, or None when they are. Pure."""
    if len(blob) < HEADER.size:
        return f"short file ({len(blob)} bytes, header is {HEADER.size})"
    magic, version, _, tag, h, length, digest = HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        return f"not a splitserve KV block file (magic {magic!r}, version {version})"
    if tag != layout_tag:
        return "written for another KV pool layout (model, dtype or block size)"
    if h != block_hash:
        return f"holds block {h:016x}, not {block_hash:016x}"
    if length != block_nbytes or len(blob) != HEADER.size + length:
        return f"payload is {len(blob) - HEADER.size} bytes, expected {block_nbytes}"
    if xxhash.xxh3_64_intdigest(memoryview(blob)[HEADER.size:]) != digest:
        return "checksum mismatch"
    return None


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, block_nbytes: int, layout_tag: int):
        self.block_nbytes = block_nbytes
        self.layout_tag = layout_tag
        self.file_nbytes = HEADER.size + block_nbytes
        self.capacity = capacity_bytes // self.file_nbytes
        if self.capacity < 1:
            raise ValueError(f"--kv-offload-dir-gib holds no block: a block file is {self.file_nbytes} bytes")
        parent = Path(directory)
        parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(parent)
        self.dir = Path(tempfile.mkdtemp(prefix=f"kv-{os.getpid()}-", dir=parent))
        self._lock_file = open(self.dir / "lock", "w")  # noqa: SIM115 (held for the tier's life)
        fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recently used first
        self.last_error = ""  # the last failed read or write, for logs

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kv"

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def write(self, block_hash: int, payload: memoryview) -> tuple[bool, list[int]]:
        """Store one block: (written, hashes evicted to make room). A failed write (a full
        disk) leaves no file and is not indexed."""
        evicted = []
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True, []
            while len(self._index) >= self.capacity:
                evicted.append(self._index.popitem(last=False)[0])
        for h in evicted:
            self.path(h).unlink(missing_ok=True)
        tmp = self.dir / f".{block_hash:016x}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(self.layout_tag, block_hash, payload))
                f.write(payload)
            os.replace(tmp, self.path(block_hash))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self.last_error = f"writing block {block_hash:016x}: {exc}"
            return False, evicted
        with self._lock:
            self._index[block_hash] = None
        return True, evicted

    def read(self, block_hash: int) -> bytes | None:
        """The block's bytes (header checked), or None: a miss. A bad file is removed."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        try:
            blob = self.path(block_hash).read_bytes()
            problem = check_file(blob, self.layout_tag, block_hash, self.block_nbytes)
        except OSError as exc:
            problem = str(exc)
        if problem is None:
            return blob[HEADER.size:]
        self.last_error = f"block {block_hash:016x}: {problem}"
        self.remove(block_hash)
        return None

    def remove(self, block_hash: int) -> bool:
        with self._lock:
            known = self._index.pop(block_hash, 0) is None
        self.path(block_hash).unlink(missing_ok=True)
        return known

    def clear(self) -> list[int]:
        with self._lock:
            hashes = list(self._index)
            self._index.clear()
        for h in hashes:
            self.path(h).unlink(missing_ok=True)
        return hashes

    def files(self) -> list[Path]:
        """Every file in the tier's directory but the lock (tests: no stray temporaries)."""
        return sorted(p for p in self.dir.iterdir() if p.name != "lock")

    def close(self) -> None:
        self.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._lock_file.close()


def remove_abandoned(parent: Path) -> None:
    """Remove the subdirectories of tiers whose process is gone (their flock is free)."""
    for sub in parent.glob("kv-*"):
        lock = sub / "lock"
        if not lock.exists():
            continue
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # alive
            shutil.rmtree(sub, ignore_errors=True)
