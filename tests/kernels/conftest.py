"""Kernel tests run every Triton kernel against its torch reference.

Without a GPU they run through Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before anything imports triton: Triton fixes the mode when
`triton.language` is defined. This conftest sets it. When running the whole suite,
test modules collected before this directory may already have imported triton in
compiled mode (torch._dynamo imports it, and transformers' model classes import
torch._dynamo); the process cannot switch any more, so the selected kernel tests are
then run once in a fresh pytest process with the interpreter on, and each test here
reports that run's outcome for its own node id.

With a CUDA device the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _triton_mode_is_usable() -> bool:
    if HAS_CUDA or "triton.language" not in sys.modules:
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)  # a jit function of triton's stdlib


IN_PROCESS = _triton_mode_is_usable()
KERNEL_DIR = Path(__file__).parent
_subprocess_outcomes: dict[str, dict] | None = None


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _own_items(items):
    return [item for item in items if KERNEL_DIR in Path(str(item.path)).parents]


def _run_in_fresh_process(config, nodeids: list[str]) -> dict[str, dict]:
    fd, name = tempfile.mkstemp(prefix="splitserve-kernel-tests-", suffix=".json")
    os.close(fd)
    report = Path(name)
    report.unlink()
    env = dict(os.environ, TRITON_INTERPRET="1", SPLITSERVE_KERNEL_REPORT=str(report))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "tests.kernels.outcome_report", *nodeids]
    proc = subprocess.run(cmd, cwd=config.rootpath, env=env, capture_output=True, text=True)
    if not report.exists():
        raise RuntimeError(f"kernel tests in a fresh process produced no report (exit {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    outcomes = json.loads(report.read_text())
    report.unlink()
    return outcomes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Only when triton was imported in compiled mode on a CPU-only machine: report the
    fresh interpreter process's outcome for this test instead of running it here."""
    global _subprocess_outcomes
    if IN_PROCESS:
        return None
    if _subprocess_outcomes is None:
        session_items = _own_items(pyfuncitem.session.items)
        _subprocess_outcomes = _run_in_fresh_process(
            pyfuncitem.config, [item.nodeid for item in session_items])
    outcome = _subprocess_outcomes.get(pyfuncitem.nodeid)
    if outcome is None:
        pytest.fail(f"{pyfuncitem.nodeid} did not run in the fresh interpreter process")
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["detail"])
    if outcome["outcome"] != "passed":
        pytest.fail("in the fresh TRITON_INTERPRET=1 process:\n" + outcome["detail"], pytrace=False)
    return True
