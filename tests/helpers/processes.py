"""Real processes for tests: redis-server, `splitserve serve`, `splitserve router`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from splitserve.core.banner import serving_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[str, subprocess.Popen]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run scripts/setup.sh (apt install redis-server)")
    for _ in range(5):  # another process may grab the port between probe and bind
        port = free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            return f"redis://127.0.0.1:{port}/0", proc
    raise RuntimeError("could not start redis-server on a free port")


class SplitserveProcess:
    """`splitserve <command> ...` as a child process; ready when it prints its URL."""

    serving: set[SplitserveProcess] = set()  # `serve` processes up now: tests/helpers/pools.py checks them
    # what stop() found still held in a live `serve`'s pools (worker states): the autouse check
    # in tests/helpers/pools.py fails the test that stopped it, as it would have at teardown
    held_at_stop: list[str] = []
    idle_timeout_s = 15.0

    def __init__(self, command: str, args: list[str], timeout: float = 180, env: dict | None = None):
        self.command = command
        self.port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ACCEPT_CALLS_FROM_PYTHON_VERSION_MISMATCH": "1",
               **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", command, "--port", str(self.port),
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if self._is_banner(line):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.proc.poll() is not None or not any(self._is_banner(ln) for ln in self.lines):
            self.stop()
            raise RuntimeError(f"splitserve {command} did not start:\n" + "".join(self.lines[-60:]))
        self.base_url = f"http://127.0.0.1:{self.port}"
        if command == "serve":
            SplitserveProcess.serving.add(self)

    @staticmethod
    def _is_banner(line: str) -> bool:
        """`splitserve: serving ... on http://...` (serve) or `splitserve router: serving ...`, anywhere
        in the line: a Ray worker's forwarded log line can precede it on the same line."""
        return serving_url(line) is not None

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, check_idle: bool = True) -> None:
        """Ctrl-C. A live `serve` first has its pools checked idle (tests/helpers/pools.py), unless
        `check_idle` is False: a test stopping it with work in flight on purpose says so."""
        was_serving = self in SplitserveProcess.serving
        SplitserveProcess.serving.discard(self)
        if was_serving and check_idle and self.proc.poll() is None:
            from tests.helpers.pools import serve_admins, wait_pools_idle

            try:
                wait_pools_idle(serve_admins(self.log()), timeout=self.idle_timeout_s)
            except AssertionError as exc:
                SplitserveProcess.held_at_stop.append(f"`serve` on port {self.port} stopped with {exc}")
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: the command stops everything it started
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def join_child(proc, timeout: float = 60.0) -> None:
    """Wait for a multiprocessing child told to end; kill it past `timeout` (a hung child must
    not outlive the test). The caller asserts its exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
