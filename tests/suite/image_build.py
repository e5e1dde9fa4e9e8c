"""The image build for tests/image, started in the background when the session starts.

A cold build (fresh machine: Debian bootstrap, pip downloads) takes 2-5 minutes, nearly all of
it waiting on the network and the disk, not the CPUs. Started at collection, it overlaps the
rest of the suite; the image fixture then waits for it (tests/image is scheduled last,
tests/suite/plan.py). Without a background build (tests/image run alone) the fixture builds
in the foreground, as before.

The build's directory is shared through SPLITSERVE_TEST_IMAGE_BUILD, set by the first pytest
process (xdist workers inherit it): `started` exists once a process launched the build, `rc`
holds its exit status, `log` its output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ENV = "SPLITSERVE_TEST_IMAGE_BUILD"
REPO = Path(__file__).resolve().parents[2]


def build_dir() -> Path:
    if ENV not in os.environ:
        os.environ[ENV] = tempfile.mkdtemp(prefix="splitserve-image-build-")
    return Path(os.environ[ENV])


def command(tag: str) -> list[str]:
    return ["bash", "scripts/build_image.sh", "--flavour", "cpu", "--tag", tag]


def start_in_background(tag: str) -> subprocess.Popen | None:
    """Launch the build unless some process of this session already did (exclusive create
    of `started`). Nice 10: while tests run, they have the CPUs first."""
    d = build_dir()
    try:
        (d / "started").open("x").close()
    except FileExistsError:
        return None
    script = f'{" ".join(command(tag))} > "{d}/log" 2>&1; echo $? > "{d}/rc.part"; mv "{d}/rc.part" "{d}/rc"'
    proc = subprocess.Popen(["nice", "-n", "10", "bash", "-c", script], cwd=REPO, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (d / "pgid").write_text(str(proc.pid))
    return proc


def stop_if_running() -> None:
    """At the end of the session (the controller's, so after every worker): a build nobody
    waited for, because the run was cut short or left tests/image out, goes."""
    d = build_dir()
    if (d / "pgid").exists() and not (d / "rc").exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int((d / "pgid").read_text()), signal.SIGTERM)


def wait_or_build(tag: str, timeout: float) -> tuple[int, str]:
    """The build's exit status and output: the background build's if one was started,
    else a build run here."""
    d = build_dir()
    if (d / "started").exists():
        deadline = time.monotonic() + timeout
        while not (d / "rc").exists():
            if time.monotonic() > deadline:
                return 124, f"the background image build did not finish within {timeout:.0f}s:\n" + _tail(d / "log")
            time.sleep(1.0)
        return int((d / "rc").read_text().strip() or 1), _tail(d / "log")
    out = subprocess.run(command(tag), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout[-6000:] + out.stderr[-6000:]


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-12000:]
    except FileNotFoundError:
        return "(no build log)"
