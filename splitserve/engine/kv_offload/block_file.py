"""A disk-tier block file: its format, and reading and writing one without trusting the directory.

File `<hash:016x>.kv` = a 64-byte header, then the block's bytes:

    magic "SSKV", version, reserved, layout tag, block hash, payload length,
    xxh3_128 of the payload, MAC

The MAC is a keyed BLAKE2b over the rest of the header (so over the payload through its
digest), under a key the tier draws at random when it starts and never writes anywhere. A
file this tier did not write (copied from another model's or another deployment's
directory, left by an earlier process, planted) fails the MAC and is a miss, even when it is
intact and its layout and hash match. The digest catches a damaged payload. Hashing the
payload with keyed BLAKE2b itself would cost ~2.5 ms per MiB here against ~0.1 for xxh3; the
MAC over the digest binds the file just as well to its writer (see docs/architecture.md for
the threat model: whoever can rewrite the tier's files is already the worker's user).

Reads trust nothing about the path: opened with O_NOFOLLOW (a symlink to /dev/zero or
/etc/passwd is refused) and O_NONBLOCK (a FIFO does not block the open), checked to be a
regular file of this process's user and of exactly the expected size before a byte is read,
and read to that size at most.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from pathlib import Path

import xxhash

MAGIC = b"SSKV"
VERSION = 2
# magic, version, reserved, layout tag, block hash, payload length, payload xxh3_128, MAC
HEADER = struct.Struct("<4sHHQQQ16s16s")
SIGNED = HEADER.size - 16  # the MAC covers every header byte before it
FILE_MODE = 0o600


class BlockFileError(OSError):
    """A file that cannot be this tier's block: not regular, wrong size, another owner."""


def encode_header(key: bytes, layout_tag: int, block_hash: int, payload: memoryview | bytes) -> bytes:
    signed = HEADER.pack(MAGIC, VERSION, 0, layout_tag, block_hash, len(payload),
                         xxhash.xxh3_128_digest(payload), b"")[:SIGNED]
    return signed + _mac(key, signed)


def _mac(key: bytes, signed: bytes) -> bytes:
    return hashlib.blake2b(signed, key=key, digest_size=16).digest()


def check_file(key: bytes, blob: bytes, layout_tag: int, block_hash: int, block_nbytes: int) -> str | None:
    """Why a file's bytes are not the block expected, or None when they are. Pure."""
    if len(blob) < HEADER.size:
        return f"short file ({len(blob)} bytes, header is {HEADER.size})"
    magic, version, _, tag, h, length, digest, mac = HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        return f"not a splitserve KV block file of version {VERSION} (magic {magic!r}, version {version})"
    if mac != _mac(key, bytes(blob[:SIGNED])):
        return "not written by this worker's tier (MAC mismatch): a foreign or forged file"
    if tag != layout_tag:
        return "written for another KV pool layout (model, dtype or block size)"
    if h != block_hash:
        return f"holds block {h:016x}, not {block_hash:016x}"
    if length != block_nbytes or len(blob) != HEADER.size + length:
        return f"payload is {len(blob) - HEADER.size} bytes, expected {block_nbytes}"
    if xxhash.xxh3_128_digest(memoryview(blob)[HEADER.size:]) != digest:
        return "checksum mismatch"
    return None


def read_block_file(path: Path, size: int) -> bytes:
    """The file's bytes, if it is a regular file of this user of exactly `size` bytes
    (raises OSError, BlockFileError included, otherwise). Never blocks on a FIFO or device,
    never follows a symlink, never reads more than `size` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BlockFileError(errno.EINVAL, f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_uid != os.geteuid():
            raise BlockFileError(errno.EPERM, f"owned by uid {st.st_uid}, not this worker's {os.geteuid()}")
        if st.st_size != size:
            raise BlockFileError(errno.EINVAL, f"{st.st_size} bytes, a block file is {size}")
        blob = bytearray(size)
        view, done = memoryview(blob), 0
        while done < size:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break  # shrank under us: the caller sees a short file
            done += n
        return bytes(view[:done])
    finally:
        os.close(fd)


def write_block_file(directory: Path, block_hash: int, header: bytes, payload: memoryview) -> Path:
    """Write header + payload under a temporary name, then rename it into place (a name never
    points at half a write). O_EXCL and O_NOFOLLOW: a name planted where the temporary goes
    (a FIFO, a symlink) is removed first, never written through. Raises OSError."""
    tmp = directory / f".{block_hash:016x}.tmp"
    final = directory / f"{block_hash:016x}.kv"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(header)
            f.write(payload)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return final
