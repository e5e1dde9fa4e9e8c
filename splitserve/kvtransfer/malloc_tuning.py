"""Keep glibc from handing streamed message buffers back to the kernel.

Every gRPC message of a KV transfer is a fresh 1 MiB-ish buffer, allocated and freed on
gRPC's threads (grpcio's slice-to-bytes copy, our chunk join). With glibc's defaults
those buffers end up mmap'd or trimmed after use, so every message pays for its pages
again: page faults plus the kernel zeroing each page. On the 2-core dev VM that was
33-45 thousand faults per 256 MB received and cost about 40% of the throughput
(bare grpcio stream: 1.2-1.4 GB/s before, 1.9-2.4 GB/s after; docs/kv_transfer.md).

Raising the mmap and trim thresholds above the message size makes freed message
buffers go back to malloc's free lists and be reused hot. The cost is that up to
`trim` bytes of freed heap stay mapped in the worker instead of being returned to the
kernel. Large allocations (the KV pool, model weights) are above the threshold and
still come from mmap. Only glibc has mallopt; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MIN_THRESHOLD = 4 << 20
_MAX_THRESHOLD = 32 << 20  # glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)

_lock = threading.Lock()
_applied = 0  # the mmap threshold set so far in this process (0: untouched)


def thresholds_for(message_bytes: int) -> tuple[int, int]:
    """(mmap threshold, trim threshold) that keep buffers of message_bytes on the heap:
    room for a couple of messages in flight, at least 4 MiB, at most glibc's 32 MiB."""
    mmap_threshold = min(_MAX_THRESHOLD, max(_MIN_THRESHOLD, 2 * int(message_bytes)))
    return mmap_threshold, 4 * mmap_threshold


def reuse_message_buffers(message_bytes: int) -> bool:
    """Raise glibc's thresholds so buffers of message_bytes are reused, not re-faulted.
    Idempotent and only ever raises them; returns whether glibc accepted the setting."""
    global _applied
    mmap_threshold, trim_threshold = thresholds_for(message_bytes)
    with _lock:
        if mmap_threshold <= _applied:
            return True
        libc = _glibc()
        if libc is None:
            return False
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
        if ok:
            _applied = mmap_threshold
            log.debug("malloc: mmap threshold %d MiB, trim threshold %d MiB (KV transfer message buffers)",
                      mmap_threshold >> 20, trim_threshold >> 20)
        else:
            log.warning("glibc refused mallopt(mmap threshold %d); KV transfers will page-fault their "
                        "message buffers and run slower", mmap_threshold)
        return ok


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None
