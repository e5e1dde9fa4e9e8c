"""A real `splitserve serve` for the chaos tests: Ray, 2 decode + 1 prefill worker actors,
the router, the embedded bus bridge and the run's cluster token, all as `make serve` starts
them. The tests attack it from outside, as a hostile client or a hostile local process
would, then check that it recovered: every engine thread alive, every KV block free, no 5xx.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.helpers.pools import (
    WORKER_LINE,
    kv_idle,
    pools_back_to_idle,  # noqa: F401 - autouse: every pool idle after each test
)
from tests.helpers.processes import SplitserveProcess
from tests.reliability.conftest import (
    SERVED,
    metric,
    reference,  # noqa: F401 - the greedy reference fixture
)

DISAGG_MIN = 64  # prompts with at least this many uncached tokens go to the prefill worker
LONG_TOKENS = 3 * DISAGG_MIN  # "long" prompts in these tests
TTL = 6.0  # the workers' heartbeat TTL (WorkerConfig's default, which `serve` uses)

_BRIDGE_LINE = re.compile(r"embedded bus bridge on grpc://(\S+)")


@dataclass
class Worker:
    role: str
    worker_id: str
    grpc: str
    kv: str | None
    admin: str

    def health(self) -> dict:
        return requests.get(self.admin + "/health", timeout=5).json()


class Serve:
    """The `splitserve serve` process and what its log says about the processes it started."""

    def __init__(self, model, workdir: Path, extra_args: list[str] = (), env: dict | None = None):
        self.model = model
        self.token_file = workdir / "cluster-token"  # only this run's processes (and the tests) read it
        self.token_file.write_text(secrets.token_urlsafe(32))
        args = ["--model", str(model), "--served-model-name", SERVED, "--prefill-workers", "1",
                "--cluster-token-file", str(self.token_file),
                "--decode-workers", "2", "--num-kv-blocks", "384", "--disagg-min-uncached-tokens", str(DISAGG_MIN),
                "--routing-seed", "5", "--max-model-len", "2048",
                "--strict-disaggregation", *extra_args]  # bursts too: the chaos aims at the disaggregated path
        self.proc = SplitserveProcess("serve", args, env=env)
        self.base_url = self.proc.base_url

    def log(self) -> str:
        return self.proc.log()

    @property
    def bridge(self) -> str:
        return _BRIDGE_LINE.search(self.log()).group(1)

    def workers(self) -> dict[str, Worker]:
        """Every worker's latest endpoints (a worker restarted by Ray logs new ones)."""
        found: dict[str, Worker] = {}
        for m in WORKER_LINE.finditer(self.log()):
            role, wid, grpc, kv, admin = m.groups()
            found[wid] = Worker(role, wid, grpc, kv, admin)
        return found

    def router_health(self) -> dict:
        return requests.get(self.base_url + "/health", timeout=5).json()

    def router_rss(self) -> int:
        """Resident bytes of the serve process (the router, the bus and the bridge live in it)."""
        with open(f"/proc/{self.proc.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib * 1024

    def server_errors(self) -> float:
        """5xx answers the router gave (its own error counter)."""
        return sum(metric(self.base_url, "splitserve_request_errors_total", code=str(code))
                   for code in (500, 502, 503, 504))

    def wait_recovered(self, timeout: float = 60.0) -> dict[str, dict]:
        """Until every worker is healthy, its engine alive and all its KV blocks free; the
        last health bodies (the assertion message names what is still wrong)."""
        deadline = time.monotonic() + timeout
        last: dict[str, dict] = {}
        while time.monotonic() < deadline:
            try:
                last = {wid: w.health() for wid, w in self.workers().items()}
            except requests.RequestException as exc:
                last = {"error": {"status": repr(exc)}}
            if len(last) == 3 and all(_recovered(h) for h in last.values()):
                return last
            time.sleep(0.2)
        raise AssertionError(f"workers did not recover within {timeout}s: {last}")

    def stop(self) -> None:
        self.proc.stop()


def _recovered(h: dict) -> bool:
    return h.get("status") == "ok" and h["engine"]["alive"] and kv_idle(h.get("kv", {})) and not h.get("streams")


@pytest.fixture(scope="session")
def serve(make_ckpt, tmp_path_factory):
    """Shared by the chaos tests: each leaves it recovered (the tests assert so)."""
    s = Serve(make_ckpt("llama"), tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()
    assert s.proc.proc.returncode == 0, s.log()[-3000:]

