"""The router's HTTP limits against a real `splitserve router` process (Redis bus, no
workers needed): a client that sends its body too slowly gets 408, one that never
finishes its headers or idles on a kept-alive connection is disconnected, a body over
the limit is 413, and the API key can come from a file (not visible in `ps`)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import pytest
import requests

from tests.helpers.processes import SplitserveProcess, start_redis

KEY = "sk-from-a-file-5d1e"
IDLE_S = 1.5


@pytest.fixture(scope="module")
def router(make_ckpt, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("router-limits")
    redis_url, redis_proc = start_redis(workdir)
    key_file = workdir / "api-key"
    key_file.write_text(KEY + "\n")
    proc = SplitserveProcess("router", ["--model", str(make_ckpt("llama")), "--redis-url", redis_url,
                                        "--api-key-file", str(key_file), "--max-request-body-mb", "1",
                                        "--body-read-timeout", "1", "--http-idle-timeout", str(IDLE_S)])
    yield proc
    proc.stop()
    redis_proc.terminate()
    redis_proc.wait(10)


def connect(router) -> socket.socket:
    url = urlparse(router.base_url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def read_all(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_that_arrives_too_slowly_is_408(router):
    with connect(router) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        began = time.monotonic()
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code": "request_timeout"' in answer and b"--body-read-timeout" in answer
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("what, sent", [("headers never finished", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"),
                                        ("nothing sent at all", b"")])
def test_a_connection_without_a_complete_request_is_closed(router, what, sent):
    with connect(router) as s:
        s.sendall(sent)
        began = time.monotonic()
        assert read_all(s) == b""  # closed, without an answer
        took = time.monotonic() - began
    assert took < IDLE_S + 3, f"{what}: the connection stayed open {took:.1f}s"


def test_an_idle_kept_alive_connection_is_closed(router):
    with connect(router) as s:
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: t\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        began = time.monotonic()
        assert read_all(s) == b""
    assert time.monotonic() - began < IDLE_S + 3


def test_a_body_over_the_limit_is_413(router):
    r = requests.post(router.base_url + "/v1/completions", data=b"x" * (2 << 20),
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "--max-request-body-mb" in r.json()["error"]["message"]


def test_the_api_key_from_a_file_is_required_and_accepted(router):
    assert requests.get(router.base_url + "/v1/models", timeout=10).status_code == 401
    r = requests.get(router.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.json()["data"]
    assert KEY not in open(f"/proc/{router.proc.pid}/cmdline", "rb").read().decode(errors="replace")
