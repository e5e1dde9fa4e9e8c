"""`splitserve serve` on the demo model, as a user starts it (its log a pipe, as in a
container), under load generators:

- `splitserve bench --input-len 32` sends prompts of exactly 32 tokens on both endpoints,
  as the server's own usage report counts them (chat: after the template).
- 200 streaming requests from clients that hang up the ways load generators do: right
  after `data: [DONE]` (a reset, or a plain close, before the response's last chunk), in
  the middle of a stream, or after reading everything. The log must stay quiet: no ERROR,
  no traceback, no ANSI colour codes, nothing from Ray's dashboard, one INFO line per
  request. This test runs last: it stops the server to check its shutdown too.

The client is raw sockets (no HTTP library of ours or anyone's): it controls exactly when
the connection goes. guidellm itself is not used here: it pulls CUDA torch (gigabytes) into
its environment; docs/operations.md gives the command and the result of a guidellm run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import struct
import time
from collections import Counter

import pytest
import requests

from splitserve.cli import main as cli_main
from tests.helpers.processes import SplitserveProcess

DEMO = "splitserve-demo-llama-random-v1"
REQUESTS = 200
CONCURRENCY = 16
MODES = ("done_reset", "done_close", "mid_reset", "mid_close", "full")
LONG = "The router tokenizes each request once and hashes the prompt block by block. " * 2
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# gRPC's C core logs as absl does ("E1125 19:45:00.127261  1234 fork_posix.cc:71] ..."), also
# from Ray's worker processes ("(WorkerActor pid=7) W1125 ..."): its fork warnings among them.
GRPC_LINE = re.compile(r"(^|\) )[EFW]\d{4} \d\d:\d\d:\d\d\.\d+ ")
# Workers' start-up lines, relayed by Ray, may arrive after the banner.
STARTUP_LINE = re.compile(r"worker \S+ serving on |KV receiver of worker \S+ listening on ")
REQUEST_LINE = re.compile(r" INFO splitserve\.router\.server: request (\S+)(?: \(client id \S+\))?: ")


@pytest.fixture(scope="module")
def serve():
    # A short disaggregation threshold: the LONG prompts also take the prefill worker and the KV push.
    proc = SplitserveProcess("serve", ["--disagg-min-uncached-tokens", "16", "--routing-seed", "3", "--strict-disaggregation"])
    yield proc
    proc.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_sends_prompts_of_exactly_input_len_tokens(serve, endpoint, tmp_path):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--base-url", serve.base_url, "--model", DEMO, "--endpoint", endpoint,
                     "--prompt-format", "text", "--input-len", "32", "--output-len", "4", "--num-prompts", "6",
                     "--no-progress", "--save-requests", "--result-file", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["input_token_source"] == "usage"  # the server's usage.prompt_tokens, not our count
    assert [(r["success"], r["prompt_tokens"]) for r in run["requests"]] == [(True, 32)] * 6


def test_workers_take_an_equal_share_of_the_cpus_at_normal_priority(serve):
    """One prefill + one decode worker share the machine's CPUs (the banner says how), and
    run at nice 0: Ray's default 15 would let any other process on the host take their CPU."""
    from splitserve.core.cpus import available_cpus

    threads = max(1, available_cpus() // 2)
    assert f"(1 prefill + 1 decode workers, {threads} torch thread(s) each, " in serve.log()
    deadline = time.monotonic() + 30  # workers' lines, relayed by Ray, may come after the banner
    while len(pids := {int(p) for p in re.findall(r"\(WorkerActor pid=(\d+)\)", serve.log())}) < 2:
        assert time.monotonic() < deadline, serve.log()[-2000:]
        time.sleep(0.2)
    assert len(pids) == 2
    assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == dict.fromkeys(pids, 0)


def body(i: int) -> tuple[str, bytes]:
    """Completions and chat, short (local prefill) and long (disaggregated) prompts."""
    text = (LONG if i % 4 < 2 else "") + f"request {i}: tell me about the weather"
    common = {"model": DEMO, "stream": True, "max_tokens": 12, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    if i % 2:
        return "/v1/chat/completions", json.dumps({**common, "messages": [{"role": "user", "content": text}]}).encode()
    return "/v1/completions", json.dumps({**common, "prompt": text}).encode()


async def one_request(port: int, i: int) -> str:
    """Send request i and hang up as MODES[i % 5] says; returns what it saw."""
    mode = MODES[i % len(MODES)]
    path, payload = body(i)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"X-Request-Id: quiet-{i}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    seen = b""
    while chunk := await reader.read(65536):
        seen += chunk
        if mode.startswith("mid") and seen.count(b"data: {") >= 2:
            break
        if mode.startswith("done") and b"data: [DONE]" in seen:
            break
        if seen.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            break
    if mode.endswith("reset"):  # RST instead of FIN, as a process that exits or a client that aborts
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    status = seen.split(b"\r\n", 1)[0]
    if status != b"HTTP/1.1 200 OK":
        return f"{mode}: {status!r}"
    if mode.startswith("mid"):
        return f"{mode}: {'streaming' if b'data: {' in seen else 'no chunk'}"
    return f"{mode}: {'done' if b'data: [DONE]' in seen else 'no [DONE]'}"


async def load(port: int) -> Counter:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def limited(i: int) -> str:
        async with slots:
            return await one_request(port, i)

    return Counter(await asyncio.gather(*(limited(i) for i in range(REQUESTS))))


def test_200_streams_that_hang_up_leave_a_quiet_log(serve):
    start = len(serve.lines)
    seen = asyncio.run(load(serve.port))
    each = REQUESTS // len(MODES)
    assert seen == Counter({"done_reset: done": each, "done_close: done": each, "mid_reset: streaming": each,
                            "mid_close: streaming": each, "full: done": each})

    # Every handler has finished (their error paths, if any, logged), then a marker request
    # whose INFO line comes after anything they could have logged.
    deadline = time.monotonic() + 60
    while requests.get(serve.base_url + "/health", timeout=10).json()["admission"]["in_flight"]:
        assert time.monotonic() < deadline, "requests still in flight a minute after their clients left"
        time.sleep(0.1)
    marker = requests.post(serve.base_url + "/v1/completions", timeout=60, json={
        "model": DEMO, "prompt": "marker", "max_tokens": 2}).headers["X-Splitserve-Request-Id"]
    while not any(marker in line for line in serve.lines[start:]):
        assert time.monotonic() < deadline, "the marker request's log line never came"
        time.sleep(0.1)

    window = serve.lines[start:]
    ids = [m.group(1) for line in window if (m := REQUEST_LINE.search(line))]
    assert len(ids) == len(set(ids)) == REQUESTS + 1  # one INFO line per request...
    assert [line for line in window if " INFO " in line and not REQUEST_LINE.search(line)
            and not STARTUP_LINE.search(line)] == []  # ...and no other
    serve.stop()
    assert serve.proc.returncode == 0
    log = serve.log()
    assert [line for line in log.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", line)] == []
    assert not ANSI.search(log) and "\x1b" not in log
    assert "dashboard" not in log.lower()
    assert [line for line in log.splitlines() if GRPC_LINE.search(line)] == []
    # Ray's forwarded lines and ours stay whole lines (logs.WholeLines): none begins inside another.
    assert [line for line in log.splitlines() if "(WorkerActor pid=" in line[1:] or "splitserve: " in line[1:]] == []
