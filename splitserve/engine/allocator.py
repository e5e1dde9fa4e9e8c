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

The engine process also gets `THP_MEM_ALLOC_ENABLE=1`, torch's switch for transparent huge
pages: its CPU allocator then asks the kernel (`madvise(MADV_HUGEPAGE)`) for 2 MB pages on
every tensor of 2 MB or more, the weights above all. A decode step streams every weight once
(SmolLM2-135M: ~540 MB a token) and on 4 KB pages paid a TLB miss every 4 KB: with huge pages
a SmolLM2 decode step at batch 1 took 2-3% less (22.5 -> 22.0 and 23.3 -> 22.6 ms, thread
time, same prompts; the native gemv alone read decoder weights at 27.3 -> 29.5 GB/s). It
needs the kernel's THP mode to be `madvise` or `always` (the usual defaults); with `never`
the advice is ignored. A value already in the environment is kept (`THP_MEM_ALLOC_ENABLE=0`
opts out).
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
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10's) switch, read once per process
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
def engine_environment(library: str | None) -> Iterator[None]:
    """For processes started inside (multiprocessing's spawn passes this process's
    environment on): LD_PRELOAD carries `library` (None: nothing preloaded), and torch's huge
    pages are on unless the environment says otherwise; both restored after."""
    with _env_lock:
        before = {name: os.environ.get(name) for name in ("LD_PRELOAD", HUGE_PAGES_ENV)}
        if library is not None:
            os.environ["LD_PRELOAD"] = f"{library}:{before['LD_PRELOAD']}" if before["LD_PRELOAD"] else library
        os.environ.setdefault(HUGE_PAGES_ENV, "1")
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def allocator_in_use() -> str:
    """'tcmalloc' when it is mapped into this process, else 'glibc malloc'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "tcmalloc" if f"lib{_LIBRARY}" in maps else "glibc malloc"
