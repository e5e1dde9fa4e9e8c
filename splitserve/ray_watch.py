"""`serve` watches the Ray processes it started, and leaves none behind (issue 39).

`serve` starts a private Ray node: its GCS, its raylet (which starts and restarts the worker
actors) and its log monitor (which relays the workers' log lines). Nothing watched them:
with the raylet killed `/health` stayed `ok` while no dead worker could come back; with the
GCS killed serving went on for a minute, then `serve` exited 1 with only Ray's "Failed to
connect to GCS" and left Ray's agents running; with the log monitor killed every worker log
line was lost without a word.

Now `serve` polls those processes every half second. When one has exited it says so in one
line naming it, its pid and exit code, and stops: nothing here can restart one part of a
Ray node under running actors, and a clean exit with a non-zero code is what lets the
supervisor (systemd, Kubernetes, a shell loop) start a whole new one. On every exit, this
one or a signal's, every process that descended from `serve` (Ray's agents included, which
a dead raylet leaves to init) is stopped too: `serve` notes its descendants as it runs, so
an orphaned one is still known by its pid and start time (a reused pid is never touched).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

WATCHED = {"gcs_server": "GCS (gcs_server)", "raylet": "raylet", "log_monitor": "log monitor"}
POLL_S = 0.5


def dead_ray_process() -> str | None:
    """One line about the first watched Ray process that has exited, or None."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)  # noqa: SLF001 - Ray keeps its Popen objects here
    if node is None:
        return None
    for kind, label in WATCHED.items():
        for info in node.all_processes.get(kind, []):
            code = info.process.poll()
            if code is not None:
                return f"Ray's {label} (pid {info.process.pid}) exited with code {code}"
    return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


class Descendants:
    """Every process that descended from this one, noted while it was one (pid -> start time)."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}

    def note(self) -> None:
        parents: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
                parents.setdefault(st[0], []).append(int(entry.name))
                starts[int(entry.name)] = st[1]
        todo = [os.getpid()]
        while todo:
            for child in parents.get(todo.pop(), []):
                self.known[child] = starts[child]
                todo.append(child)

    def alive(self) -> list[int]:
        return [pid for pid, start in self.known.items() if (st := _stat(pid)) is not None and st[1] == start]

    def stop_all(self, grace_s: float = 5.0) -> list[int]:
        """SIGTERM every one still alive, SIGKILL what is left after `grace_s`; the pids signalled."""
        signalled = self.alive()
        for pid in signalled:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.alive():
            _signal(pid, signal.SIGKILL)
        return signalled


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def watch(descendants: Descendants, stop: asyncio.Event) -> str | None:
    """Until `stop` is set: note descendants now and then, and return the line about a dead
    Ray process (setting `stop`) if one dies."""
    ticks = 0
    while not stop.is_set():
        if ticks % 4 == 0:
            await asyncio.to_thread(descendants.note)
        ticks += 1
        why = dead_ray_process()
        if why is not None:
            stop.set()
            return why
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except TimeoutError:
            pass
    return None
