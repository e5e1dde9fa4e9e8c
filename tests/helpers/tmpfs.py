"""A tmpfs mounted for a test: a filesystem that really fills up, or is really read-only."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size: str, options: str = ""):
    """Mount a tmpfs of `size` (e.g. "8m") at `path` (made here), with extra mount `options`
    (e.g. ",ro"); skips the test where mounting is not allowed (CI and the dev machines run
    as root: it is)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI and the dev machines run as root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
