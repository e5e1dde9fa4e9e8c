"""The disk tier: one file per KV block under a local directory, keyed by block hash.

The file format and the careful reads and writes are in block_file.py: a file this tier did
not write is a miss (MAC), and no file can block or flood a read. A missing, short, foreign
or corrupt file is a miss (the caller recomputes), and the file is dropped.

Each tier owns a fresh subdirectory `kv-<pid>-<random>` (mode 0700) of the configured
directory and holds an exclusive flock on its `lock` file while alive: several workers may
share one directory (an emptyDir), and a later tier removes the subdirectories of dead ones.

Nothing here raises on an I/O error: every operation returns what went wrong, for the
offloader to count, log and feed its switch (disk_guard.py). The directory deleted under a
running tier is made again at the next write, its blocks counted lost (`take_lost`). The
tier holds at most `capacity` blocks (the flag) and at most what the filesystem has room for,
less a reserve: on a full disk its own least recently used blocks make room for new ones.
Thread-safe: the index is guarded by a lock; file I/O (meant for the disk thread) runs
outside it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from splitserve.engine.kv_offload.block_file import (
    HEADER,
    check_file,
    encode_header,
    read_block_file,
    write_block_file,
)

# Free space the tier leaves on its filesystem for everyone else: 64 MiB, or 5% of a small one.
RESERVE_BYTES, RESERVE_FRACTION = 64 * 2**20, 0.05


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, block_nbytes: int, layout_tag: int,
                 reserve_bytes: int | None = None):
        self.block_nbytes = block_nbytes
        self.layout_tag = layout_tag
        self.file_nbytes = HEADER.size + block_nbytes
        self.capacity = capacity_bytes // self.file_nbytes  # the flag's; room_for() may allow fewer
        if self.capacity < 1:
            raise ValueError(f"--kv-offload-dir-gib holds no block: a block file is {self.file_nbytes} bytes")
        self.reserve_bytes = reserve_bytes
        self.parent = Path(directory)
        self.key = secrets.token_bytes(32)  # binds each file to this tier (block_file.py); never stored
        self._lock = threading.Lock()
        self._index: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recently used first
        self._lost: list[int] = []  # indexed blocks whose files went with the directory
        self._undeleted: set[int] = set()  # evicted blocks whose files could not be removed (yet)
        self._remove_failures, self._remove_last = 0, ""  # since take_remove_failures(), and the last
        self.room = self.capacity  # blocks the filesystem had room for at the last write
        self.dir: Path | None = None
        self._lock_file = None
        self.start_problem = self._open_directory()  # None, or why the tier starts without a directory

    def path(self, block_hash: int) -> Path:
        return (self.dir or self.parent) / f"{block_hash:016x}.kv"

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def effective_capacity(self) -> int:
        return min(self.capacity, self.room)

    def take_lost(self) -> list[int]:
        """Blocks that left the tier without a write or read saying so (the directory vanished)."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    # ---- file operations (the disk thread) -------------------------------------------------
    def write(self, block_hash: int, payload: memoryview) -> tuple[bool, list[int], str | None]:
        """Store one block: (written, hashes evicted to make room, what went wrong). A failed
        write leaves no file and is not indexed."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True, [], None
        problem = self.ensure_directory()
        if problem:
            return False, [], problem
        self._retry_undeleted()
        limit = min(self.capacity, self._room_for())
        evicted = []
        with self._lock:
            while self._index and len(self._index) >= limit:
                evicted.append(self._index.popitem(last=False)[0])
        for h in evicted:
            self._unlink(h)
        if limit < 1:
            return False, evicted, f"no room on the filesystem of {self.parent} (free space is under the " \
                                   "tier's reserve): the tier holds nothing until space is freed"
        try:
            write_block_file(self.dir, block_hash, encode_header(self.key, self.layout_tag, block_hash, payload),
                             payload)
        except OSError as exc:
            return False, evicted, f"writing block {block_hash:016x} in {self.dir}: {describe(exc)}"
        with self._lock:
            self._index[block_hash] = None
        return True, evicted, None

    def read(self, block_hash: int) -> tuple[bytes | None, str | None]:
        """(the block's bytes, None), or (None, why not): a miss. A bad file is removed."""
        with self._lock:
            if block_hash not in self._index:
                return None, f"block {block_hash:016x} is no longer on disk"
            self._index.move_to_end(block_hash)
        try:
            blob = read_block_file(self.path(block_hash), self.file_nbytes)
            problem = check_file(self.key, blob, self.layout_tag, block_hash, self.block_nbytes)
        except OSError as exc:
            problem = describe(exc)
        if problem is None:
            return blob[HEADER.size:], None
        with self._lock:
            self._index.pop(block_hash, None)
        self._unlink(block_hash)
        self.ensure_directory()  # a read that failed because the directory went: it comes back
        return None, f"block {block_hash:016x} in {self.dir}: {problem}"

    def clear(self) -> list[int]:
        """Forget every block (at once) and remove their files (here: call on the disk thread)."""
        with self._lock:
            hashes = list(self._index)
            self._index.clear()
        return hashes

    def unlink_files(self, hashes: list[int]) -> None:
        for h in hashes:
            self._unlink(h)

    def take_remove_failures(self) -> tuple[int, str]:
        """How many files could not be removed since the last call, and the last reason."""
        with self._lock:
            n, self._remove_failures = self._remove_failures, 0
            return n, self._remove_last

    def files(self) -> list[Path]:
        """Every file in the tier's directory but the lock (tests: no stray temporaries)."""
        return sorted(p for p in self.dir.iterdir() if p.name != "lock") if self.dir else []

    def close(self) -> None:
        self.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ---- the directory -------------------------------------------------------------------
    def _open_directory(self) -> str | None:
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
            remove_abandoned(self.parent)
            directory = Path(tempfile.mkdtemp(prefix=f"kv-{os.getpid()}-", dir=self.parent))  # mode 0700
            lock_file = open(directory / "lock", "w")  # noqa: SIM115 (held for the tier's life)
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            return f"cannot use {self.parent} for the disk KV tier: {describe(exc)}"
        self.dir, self._lock_file = directory, lock_file
        return None

    def ensure_directory(self) -> str | None:
        """The tier's directory, made again if it was deleted (or replaced by something else)."""
        if self.dir is not None:
            try:
                if stat.S_ISDIR(os.lstat(self.dir).st_mode):
                    return None
            except OSError:
                pass
            with self._lock:  # its files went with it
                self._lost += self._index
                self._index.clear()
            self._undeleted.clear()
            if self._lock_file is not None:
                self._lock_file.close()
            self.dir, self._lock_file = None, None
        return self._open_directory()

    def _room_for(self) -> int:
        """Blocks the tier may hold given the filesystem's free space (its own files count as room)."""
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return self.capacity
        reserve = self.reserve_bytes
        if reserve is None:
            reserve = min(RESERVE_BYTES, int(st.f_blocks * st.f_frsize * RESERVE_FRACTION))
        free = st.f_bavail * st.f_frsize - reserve
        self.room = len(self._index) + max(0, free) // self.file_nbytes
        return self.room

    def _unlink(self, block_hash: int, retry: bool = False) -> None:
        try:
            self.path(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            self._undeleted.add(block_hash)  # it still takes space: tried again at each write
            if not retry:
                with self._lock:
                    self._remove_failures += 1
                    self._remove_last = f"removing {self.path(block_hash)}: {describe(exc)}"
            return
        self._undeleted.discard(block_hash)

    def _retry_undeleted(self) -> None:
        """Remove the files that could not be removed before (made immutable, say), unless the
        block was written again since."""
        for h in list(self._undeleted):
            if h in self._index:
                self._undeleted.discard(h)
            else:
                self._unlink(h, retry=True)


def describe(exc: OSError) -> str:
    """An OSError in one line, without the Python type noise."""
    return f"{exc.strerror or exc} (errno {exc.errno})" if exc.errno else str(exc)


def remove_abandoned(parent: Path) -> None:
    """Remove the subdirectories of tiers whose process is gone (their flock is free)."""
    for sub in parent.glob("kv-*"):
        lock = sub / "lock"
        try:
            if not lock.is_file() or lock.is_symlink():
                continue
            with open(lock, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # alive
                shutil.rmtree(sub, ignore_errors=True)
        except OSError:
            continue  # not ours to judge: leave it
