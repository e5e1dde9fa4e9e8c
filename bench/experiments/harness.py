"""Shared plumbing of the serving experiments: start a real `splitserve serve`, run the
real `splitserve bench` against it, scrape the workers' Prometheus counters, stop.

Every configuration of an experiment runs through the same commands a user would
type, one after the other on this machine, so their numbers are comparable. The
machine's load average is recorded around each run: other jobs on a shared machine
change timings, and a reader needs to know.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.core.banner import serving_url
from splitserve.simulator.serving_probe import stop_process_group

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SERVED_NAME = "demo"
# `splitserve: decode worker decode-0: gRPC HOST:PORT, ..., metrics http://HOST:PORT/metrics`
_METRICS_LINE = re.compile(r"splitserve: (decode|prefill) worker (\S+): .*\bmetrics (http://\S+/metrics)")
_SAMPLE = re.compile(r'^(splitserve_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$')


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", *args]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Server:
    """A running `splitserve serve`, its base URL and its workers' metrics URLs."""

    proc: subprocess.Popen
    base_url: str
    command: list[str]
    metrics_urls: dict[str, str] = field(default_factory=dict)  # worker id -> /metrics URL
    lines: list[str] = field(default_factory=list)


def _launch(args: list[str], timeout_s: float) -> Server:
    port = free_port()
    command = cli("serve", "--port", str(port), "--served-model-name", SERVED_NAME, *args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=REPO)
    server = Server(proc, f"http://127.0.0.1:{port}", command)
    banner, ended = threading.Event(), threading.Event()

    def read() -> None:
        for line in proc.stdout:
            server.lines.append(line)
            m = _METRICS_LINE.search(line)
            if m:
                server.metrics_urls[m.group(2)] = m.group(3)
            if serving_url(line):
                banner.set()
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not banner.is_set() and not ended.is_set() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not banner.is_set() or proc.poll() is not None:
        stop_process_group(proc)
        tail = "".join(server.lines[-40:])
        raise RuntimeError(f"`{shlex.join(command)}` did not come up within {timeout_s:.0f}s:\n{tail}")
    return server


@contextmanager
def serve(args: list[str], timeout_s: float = 240.0, attempts: int = 3):
    """`splitserve serve ARGS` until the block exits (Ctrl-C, as a user would stop it).
    A start that fails (Ray's node can time out starting on a busy shared machine) is
    retried, and each failure printed."""
    for attempt in range(1, attempts + 1):
        try:
            server = _launch(args, timeout_s)
            break
        except RuntimeError as exc:
            if attempt == attempts:
                raise
            print(f"[experiment] start {attempt} of {attempts} failed, retrying:\n{exc}", flush=True)
            time.sleep(5)
    print(f"[experiment] serving: {shlex.join(server.command[2:])}", flush=True)
    try:
        yield server
    finally:
        stop_process_group(server.proc)


def run_bench(server: Server, args: list[str], label: str) -> dict:
    """`splitserve bench` against `server`; returns its first run's record (plus the
    per-request records, --save-requests) and the command line used."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = cli("bench", "--base-url", server.base_url, "--model", SERVED_NAME, "--no-progress",
                      "--save-requests", "--label", label, "--result-file", str(out), *args)
        done = subprocess.run(command, cwd=REPO, text=True, capture_output=True)
        if done.returncode != 0:
            state = "exited" if server.proc.poll() is not None else "still running"
            raise RuntimeError(f"`{shlex.join(command)}` failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n"
                               f"server ({state}) log tail:\n" + "".join(server.lines[-40:]))
        print(done.stdout.split("[bench] results written")[0].rstrip(), flush=True)
        document = json.loads(out.read_text())
    run = document["runs"][0]
    run["bench_command"] = "splitserve " + shlex.join(command[3:]).replace(str(out), "RESULT.json")
    return run


def scrape(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """worker id -> {metric name: value summed over label sets} for every `splitserve_*`
    sample in its /metrics page."""
    out: dict[str, dict[str, float]] = {}
    for worker, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        sums: dict[str, float] = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
        out[worker] = sums
    return out


def prefix_hit_rate(samples: dict[str, dict[str, float]], role: str = "decode") -> dict:
    """Prompt tokens found in the workers' prefix caches / prompt tokens looked up."""
    queries = sum(s.get("splitserve_prefix_cache_queries_total", 0.0)
                  for w, s in samples.items() if w.startswith(role))
    hits = sum(s.get("splitserve_prefix_cache_hits_total", 0.0) for w, s in samples.items() if w.startswith(role))
    return {"query_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries if queries else None}


def settle_metrics(server: Server, wait_s: float = 2.0) -> dict[str, dict[str, float]]:
    """Workers copy engine counters into Prometheus on each load report (every 0.5 s):
    wait a few reports, then scrape."""
    time.sleep(wait_s)
    return scrape(server.metrics_urls)


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"[experiment] wrote {path}", flush=True)


def strip_requests(run: dict) -> dict:
    """The run record without per-request rows (kept out of the committed JSON)."""
    return {k: v for k, v in run.items() if k != "requests"}
