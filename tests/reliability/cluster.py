"""A cluster of real OS processes for fault injection: redis-server (restartable on its
port), decode workers (`splitserve decode-worker`), plain prefill worker processes and
routers (`splitserve router`). Each process can be SIGKILLed like a crashed pod."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import requests

from splitserve.engine.faults import ENV as FAULT_ENV
from tests.helpers.pools import kv_idle
from tests.helpers.processes import free_port

SERVED = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]


class Proc:
    """A child process whose output is kept; ready once a line matches `banner`."""

    def __init__(self, name: str, argv: list[str], banner: str, timeout: float = 120, env: dict | None = None):
        self.name = name
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True, cwd=ROOT)
        self.lines: list[str] = []
        self.match: re.Match | None = None
        ready = threading.Event()
        pattern = re.compile(banner)

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if self.match is None and (m := pattern.search(line)):
                    self.match = m
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.match is None:
            self.kill()
            raise RuntimeError(f"{name} did not start:\n" + "".join(self.lines[-40:]))

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing is cleaned up by the process itself."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP the process group: nothing it holds progresses or finishes until killed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT the process group after freeze()."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", name]


@dataclass
class Cluster:
    model: Path
    workdir: Path
    tls_args: list[str] = field(default_factory=list)
    redis_port: int = field(default_factory=free_port)
    redis: subprocess.Popen | None = None
    decode: dict[str, Proc] = field(default_factory=dict)
    prefill: dict[str, Proc] = field(default_factory=dict)
    routers: list[Proc] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=lambda: ["--num-kv-blocks", "256", "--max-num-seqs", "32"])
    # Every decode step takes this much longer (engine/faults.py's `slow`): a 200-token stream
    # then lasts >= 2 s whatever the machine's speed, so a fault fired after a stream's first
    # chunks lands mid-stream even when the test client was descheduled for a second (with a
    # full-speed engine on 2 busy cores, streams sometimes ended before their fault did).
    decode_step_ms: float = 10.0

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    # ---- processes ------------------------------------------------------------------
    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup.sh (apt install redis-server)")
        self.redis = subprocess.Popen([binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(self.workdir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.redis_port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.redis_port}") from None
                time.sleep(0.05)
        client.close()

    def kill_redis(self) -> None:
        self.redis.kill()
        self.redis.wait(timeout=10)

    def common(self) -> list[str]:
        return ["--model", str(self.model), "--served-model-name", SERVED, "--redis-url", self.redis_url,
                *self.tls_args]

    def start_decode(self, worker_id: str) -> Proc:
        slow = [{"engine": worker_id, "fault": "slow", "at_step": 0, "step_ms": self.decode_step_ms}]
        p = Proc(worker_id, [*_module("splitserve.cli"), "decode-worker", *self.common(), *self.engine_args,
                             "--worker-id", worker_id, "--port", "0", "--admin-port", "0", "--drain-port", "0", "--drain-timeout", "5"],
                 r"serving gRPC on (\S+), KV receiver (\S+), admin (\S+)",
                 env={FAULT_ENV: json.dumps(slow)} if self.decode_step_ms else None)
        self.decode[worker_id] = p
        return p

    def start_prefill(self, worker_id: str, module: str = "splitserve.prefill_worker.main",
                      extra: list[str] = ()) -> Proc:
        p = Proc(worker_id, [*_module(module), *self.common(), *self.engine_args, "--worker-id", worker_id,
                             "--port", "0", "--metrics-port", "0", *extra],
                 r"serving gRPC on (\S+), metrics (\S+)")
        self.prefill[worker_id] = p
        return p

    def start_router(self, extra: list[str] = ()) -> Proc:
        port = free_port()
        p = Proc("router", [*_module("splitserve.cli"), "router", *self.common(), "--port", str(port),
                            "--routing-seed", "7", "--disagg-min-uncached-tokens", "24",
                            "--strict-disaggregation", *extra],  # bursts too: these tests aim at the KV transfer
                 r"splitserve router: serving .* on (http://\S+)/v1")
        p.base_url = f"http://127.0.0.1:{port}"
        self.routers.append(p)
        return p

    def stop(self) -> None:
        for p in [*self.routers, *self.decode.values(), *self.prefill.values()]:
            p.stop()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(timeout=10)

    # ---- state ------------------------------------------------------------------------
    def wait_registered(self, router: Proc, timeout: float = 60) -> dict:
        """Until the router sees exactly the live worker processes, at their current addresses:
        a worker restarted under the same id is listed before the router has read its new
        registration (its log names each address it learns)."""
        want_d, want_p = sorted(self.live(self.decode)), sorted(self.live(self.prefill))
        addresses = [p.match.group(1) for p in [*self.live(self.decode).values(), *self.live(self.prefill).values()]]
        deadline = time.monotonic() + timeout
        while True:
            body = requests.get(router.base_url + "/health", timeout=10).json()
            learned = router.log()
            if (body["decode_workers"] == want_d and body["prefill_workers"] == want_p
                    and all(f"at {a}" in learned for a in addresses)):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"router sees {body['decode_workers']} + {body['prefill_workers']}, "
                                     f"expected {want_d} + {want_p}")
            time.sleep(0.2)

    @staticmethod
    def live(procs: dict[str, Proc]) -> dict[str, Proc]:
        return {k: p for k, p in procs.items() if p.proc.poll() is None}

    def kv_states(self) -> dict[str, dict]:
        out = {}
        for name, p in self.live(self.decode).items():
            out[name] = requests.get(p.match.group(3) + "/health", timeout=10).json()["kv"]
        for name, p in self.live(self.prefill).items():
            out[name] = requests.get(p.match.group(2) + "/health", timeout=10).json()["kv"]
        return out

    def wait_all_blocks_free(self, timeout: float = 30) -> dict[str, dict]:
        """Every live worker's free KV blocks back to its total, nothing held or leased."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.kv_states()
            if all(kv_idle(s) for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still in use: {states}")
            time.sleep(0.2)
