"""The engine process's memory allocator: tcmalloc where the machine has it, as vLLM's CPU
backend preloads it.

Why: a CPU prefill step allocates its activations afresh (a 2,048-token step of the demo
model: ~80 MB of tensors of 1-12 MB). glibc's malloc serves blocks that large from fresh
mmaps or a heap it trims back after each step, so every step faulted its pages in again:
15,000-22,000 minor page faults a step, and 130-145 ms where the same step took 110-118 ms
with tcmalloc, which keeps the freed spans for the next step (measured with the offline
engine, one pinned thread; `docs/benchmarks.md`). That was most of the gap between our
prefill step and vLLM's "tuned" one.

tcmalloc has to be in the process before anything allocates, so it is preloaded
(`LD_PRELOAD`) into the spawned engine process only: the router and the workers' event loops
allocate little. Where no tcmalloc is installed (Debian/Ubuntu: `libtcmalloc-minimal4`) the
engine runs on glibc's malloc and says so once; `SPLITSERVE_ENGINE_MALLOC=system` chooses
that deliberately.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SPLITSERVE_ENGINE_MALLOC"  # auto (default) | tcmalloc | system
_LIBRARY = "tcmalloc_minimal"  # the allocator alone, without the profiler's library
_env_lock = threading.Lock()


def engine_malloc() -> str:
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "tcmalloc", "system"):
        raise ValueError(f"{ENV}={choice!r} is not one of auto, tcmalloc, system")
    return choice


def find_tcmalloc() -> str | None:
    """The tcmalloc library's name as the dynamic loader finds it, or None."""
    return ctypes.util.find_library(_LIBRARY)


def engine_preload() -> str | None:
    """The library to preload into an engine process (None: glibc's malloc), by ENV."""
    choice = engine_malloc()
    if choice == "system":
        return None
    library = find_tcmalloc()
    if library is None and choice == "tcmalloc":
        raise RuntimeError(f"{ENV}=tcmalloc but no lib{_LIBRARY} is installed (Debian/Ubuntu: apt-get install "
                           "libtcmalloc-minimal4)")
    return library


@contextlib.contextmanager
def preloaded(library: str | None) -> Iterator[None]:
    """LD_PRELOAD carries `library` for processes started inside (multiprocessing's spawn
    passes this process's environment on); restored after."""
    if library is None:
        yield
        return
    with _env_lock:
        before = os.environ.get("LD_PRELOAD")
        os.environ["LD_PRELOAD"] = f"{library}:{before}" if before else library
        try:
            yield
        finally:
            if before is None:
                del os.environ["LD_PRELOAD"]
            else:
                os.environ["LD_PRELOAD"] = before


def allocator_in_use() -> str:
    """'tcmalloc' when it is mapped into this process, else 'glibc malloc'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "tcmalloc" if f"lib{_LIBRARY}" in maps else "glibc malloc"
