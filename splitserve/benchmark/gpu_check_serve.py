"""The GPU check's serving stage: `splitserve serve` with one prefill and one decode worker
on one device, a short `splitserve bench` load through it, then the decode worker's
metrics, once per KV-transfer backend.

It passes when every request completed, the prompts were prefilled by the prefill
worker (KV bytes received by the decode worker over that backend, no local-prefill
fallback, no transfer error) and the server shut down. Prompts are longer than
--disagg-min-uncached-tokens so the router sends each one to the prefill worker.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from splitserve.core.banner import serving_url

SERVED = "gpu-check"
_METRICS = re.compile(r"splitserve: (decode|prefill) worker (\S+?): .*?metrics (http://[0-9.:]+)/metrics")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each metric family's samples summed (labels apart) from a /metrics page."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Server:
    """`splitserve serve` in a subprocess, its output collected on a thread."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(self.port),
               "--served-model-name", SERVED, *args]
        self.command = cmd
        self.lines: list[str] = []
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(serving_url(line) for line in self.lines):
                return True
            time.sleep(0.5)
        return False

    def worker_metrics(self) -> dict[str, str]:
        return {m.group(1): m.group(3) for m in _METRICS.finditer("".join(self.lines))}

    def stop(self, timeout: float = 90) -> int | None:
        """Ctrl-C as a user would; killed if it does not finish in time (None then)."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=5)
        self.log.close()
        return code


def run_backend(backend: str, device: str, dtype: str, model: str | None, prompts: int, input_len: int,
                output_len: int, workdir: Path, start_timeout: float, extra: tuple[str, ...] = (),
                name: str | None = None) -> dict:
    """One serve with `backend` (plus `extra` flags; `name` labels its files and row)."""
    name = name or backend
    args = ["--device", device, "--dtype", dtype, "--kv-backend", backend, "--prefill-workers", "1",
            "--decode-workers", "1", "--disagg-min-uncached-tokens", str(input_len // 2), *extra]
    if model:
        args += ["--model", model]
    server = Server(args, workdir / f"serve_{name}.log")
    row: dict = {"backend": name, "command": " ".join(server.command[2:])}
    try:
        started = time.monotonic()
        if not server.wait_ready(start_timeout):
            row.update(ok=False, reason=f"serve did not start in {start_timeout:.0f} s",
                       log_tail="".join(server.lines[-30:])[-3000:])
            return row
        row["startup_seconds"] = time.monotonic() - started
        result = workdir / f"bench_{name}.json"
        load = [sys.executable, "-m", "splitserve.cli", "bench", "--base-url", f"http://127.0.0.1:{server.port}",
                "--model", SERVED, "--num-prompts", str(prompts), "--input-len", str(input_len),
                "--output-len", str(output_len), "--ignore-eos", "--max-concurrency", "8",
                "--result-file", str(result), "--no-progress"]
        proc = subprocess.run(load, capture_output=True, text=True, timeout=max(120.0, start_timeout))
        if proc.returncode != 0 or not result.exists():
            row.update(ok=False, reason=f"splitserve bench exited {proc.returncode}",
                       log_tail=(proc.stdout + proc.stderr)[-3000:])
            return row
        run = json.loads(result.read_text())["runs"][0]
        row.update({k: run[k] for k in ("completed", "failed", "duration_s", "output_throughput")})
        row.update(ttft_ms=run["ttft_ms"], tpot_ms=run["tpot_ms"])
        decode_url = server.worker_metrics().get("decode")
        kv = metric_sums(decode_url, ("splitserve_kv_transfer_bytes_total", "splitserve_kv_transfer_errors_total",
                                      "splitserve_local_prefill_fallbacks_total")) if decode_url else {}
        row["decode_worker_metrics"] = kv
        problems = []
        if run["completed"] != prompts or run["failed"]:
            problems.append(f"{run['completed']} of {prompts} requests completed, {run['failed']} failed")
        if not kv.get("splitserve_kv_transfer_bytes_total"):
            problems.append("the decode worker received no KV bytes: nothing was prefilled remotely")
        if kv.get("splitserve_kv_transfer_errors_total") or kv.get("splitserve_local_prefill_fallbacks_total"):
            problems.append("KV transfer errors or local-prefill fallbacks")
        row.update(ok=not problems, reason="; ".join(problems) or "all requests completed, KV moved by " + backend)
    finally:
        code = server.stop()
        row["exit_code"] = code
        if code is None and row.get("ok"):
            row.update(ok=False, reason="serve did not shut down within 90 s of Ctrl-C")
    return row
