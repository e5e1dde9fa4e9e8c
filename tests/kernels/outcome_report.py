"""pytest plugin used by tests/kernels/conftest.py: writes each test's outcome (and the
failure text) as JSON to $SPLITSERVE_KERNEL_REPORT when the session ends."""

from __future__ import annotations

import json
import os

_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
    if report.failed:
        entry["outcome"] = "failed"
        entry["detail"] += f"[{report.when}] {report.longreprtext}\n"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["detail"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else report.longreprtext


def pytest_sessionfinish(session):
    path = os.environ.get("SPLITSERVE_KERNEL_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f)
