"""The runtime LoRA API under hostile use (issue 48), against a real stack in this process:
a decode worker with --enable-lora --max-loras 2 (the engine in a thread, gRPC for real), the
router's aiohttp app with an API key and a distinct admin key, runtime updating on.

- Malformed adapters (a config that is a list, `lora_alpha: "sixteen"`, r negative or not an
  integer, target_modules of the wrong type, NaN, no JSON, damaged weights) are each a 400 in
  OpenAI's error shape naming the field, with nothing internal in the body and no traceback
  in any log; an unexpected worker failure is a 503 that says which worker, not why.
- Names: 10,000 characters, a newline, a space are refused (400 naming lora_name); the CLI
  refuses the same names in one line.
- Load / unload take the admin key: the API key gets 403, no key 401; with only --api-key set
  nobody may; with neither key (a development server) anyone may.
- A request under an adapter unloaded meanwhile gets 404 model_not_found, never a 200 and
  then an error event: both when the router knows of the unload (it is in flight) and when
  only the worker does (a request routed just before).
- After a storm of loads, unloads and requests, the workers' splitserve_lora_resident lists
  exactly the adapters /v1/models lists, at most --max-loras of them at 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests
from aiohttp import web

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.lora import RUNTIME_ENV
from splitserve.router.server import RouterServer, ServerConfig
from tests.helpers.processes import free_port

SERVED = "lora-base"
KEY, ADMIN = "sk-client-1b2c", "sk-admin-9f8e"
INTERNALS = ("AioRpcError", "StatusCode", "Traceback", "TypeError", "grpc", "Exception")


@dataclass
class LoRAStack:
    urls: dict[str, str]  # "main" (key + admin key), "key-only", "open" (no keys)
    decode: DecodeWorker
    server: RouterServer
    adapter: str  # a good PEFT adapter directory
    loop: asyncio.AbstractEventLoop

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, body, key: str | None = ADMIN, server: str = "main", **kw) -> requests.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(self.urls[server] + path, json=body, headers=headers, timeout=30, **kw)

    def load(self, name: str, path: str | None = None, **kw) -> requests.Response:
        return self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path or self.adapter}, **kw)

    def unload(self, name: str, **kw) -> requests.Response:
        return self.post("/v1/unload_lora_adapter", {"lora_name": name}, **kw)

    def models(self) -> list[str]:
        r = requests.get(self.urls["main"] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        return sorted(m["id"] for m in r.json()["data"] if m["id"] != SERVED)

    def complete(self, model: str, stream: bool = False, n: int = 1) -> requests.Response:
        body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": stream, "n": n}
        return self.post("/v1/completions", body, key=KEY, stream=stream)


@pytest.fixture(scope="module")
def lora_stack(make_ckpt, tmp_path_factory):
    from tests.helpers.lora_adapters import ADAPTERS, make_adapter

    model = make_ckpt("llama")
    adapter = make_adapter(model, tmp_path_factory.mktemp("adapters") / "all-r8", **ADAPTERS["all-r8"])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="lora-stack")
    thread.start()

    async def start():
        engine = EngineConfig(model=str(model), num_kv_blocks=64, model_id=SERVED, max_model_len=64,
                              enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"boot": str(adapter)})
        bus = InProcBus()
        decode = DecodeWorker(DecodeWorkerConfig(engine, worker_id="d0", admin_port=0), bus=bus)
        await decode.start()
        dispatcher = Dispatcher(DispatchConfig(model_id=SERVED, seed=7), bus)
        await dispatcher.start()
        while "d0" not in dispatcher.sync.loads:  # registered and its first report (its adapters) in
            await dispatcher.sync.refresh()
            await asyncio.sleep(0.05)
        runners, urls, main = [], {}, None
        os.environ[RUNTIME_ENV] = "1"  # read when each app is built
        try:
            for label, key, admin in (("main", KEY, ADMIN), ("key-only", KEY, None), ("open", None, None)):
                server = RouterServer(ServerConfig(str(model), SERVED, api_key=key, admin_api_key=admin,
                                                   max_model_len=64), dispatcher)
                runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
                await runner.setup()
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                runners.append(runner)
                urls[label] = f"http://127.0.0.1:{port}"
                main = main or server
        finally:
            del os.environ[RUNTIME_ENV]
        return LoRAStack(urls, decode, main, str(adapter), loop), runners, dispatcher

    stack, runners, dispatcher = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield stack

    async def stop():
        for runner in runners:
            await runner.cleanup()
        await dispatcher.stop()
        await stack.decode.stop()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def error_of(r: requests.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response that must have `status`, with nothing internal in it."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["Content-Type"].startswith("application/json"), r.headers["Content-Type"]
    for word in INTERNALS:
        assert word not in r.text, (word, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], err
    return err


def no_tracebacks(caplog) -> None:
    for record in caplog.records:
        assert record.exc_info is None and "Traceback" not in record.getMessage(), record.getMessage()[:2000]


def adapter_with(src: str, dst, config: bytes | None = None, weights: bytes | None = None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "adapter_config.json").write_bytes(config)
    if weights is not None:
        (dst / "adapter_model.safetensors").write_bytes(weights)
    return str(dst)


def edited(src: str, **changes) -> bytes:
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    return json.dumps(cfg).encode()


def test_malformed_adapters_are_400s_naming_the_field_with_no_traceback(lora_stack, tmp_path, caplog):
    s = lora_stack
    caplog.set_level(logging.INFO)
    before = s.models()
    cases = {  # name -> (config, weights, words the message must hold)
        "alpha-word": (edited(s.adapter, lora_alpha="sixteen"), None, "lora_alpha must be a finite number, got 'sixteen'"),
        "alpha-nan": (edited(s.adapter).replace(b'"lora_alpha": 16', b'"lora_alpha": NaN'), None, "lora_alpha"),
        "a-list": (b'[{"r": 8, "lora_alpha": 16}]', None, "adapter_config.json must be a JSON object, got a list"),
        "r-negative": (edited(s.adapter, r=-4), None, "r must be a positive integer, got -4"),
        "r-string": (edited(s.adapter, r="8"), None, "r must be a positive integer, got '8'"),
        "r-bool": (edited(s.adapter, r=True), None, "r must be a positive integer, got True"),
        "r-float": (edited(s.adapter, r=8.0), None, "r must be a positive integer, got 8.0"),
        "targets": (edited(s.adapter, target_modules=5), None, "target_modules must be a string or a list"),
        "targets-mixed": (edited(s.adapter, target_modules=["q_proj", 3]), None, "target_modules"),
        "rslora": (edited(s.adapter, use_rslora="yes"), None, "use_rslora must be true or false"),
        "pattern": (edited(s.adapter, rank_pattern=[1]), None, "rank_pattern must be an object"),
        "not-json": (b"{r: 8", None, "is not JSON"),
        "weights": (None, b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", "cannot read"),
    }
    for name, (config, weights, words) in cases.items():
        path = adapter_with(s.adapter, tmp_path / name, config, weights)
        err = error_of(s.load(name, path), 400)
        assert err["type"] == "invalid_request_error" and err["param"] == "lora_path", (name, err)
        assert words in err["message"] and f"'{name}'" in err["message"], (name, err["message"])
    assert s.models() == before  # nothing loaded anywhere
    no_tracebacks(caplog)


def test_an_unexpected_worker_failure_is_a_clean_503_and_one_log_line(lora_stack, caplog):
    s = lora_stack
    engine = s.decode.engine

    async def broken(name, path):
        raise RuntimeError("secret internal detail /srv/engine.py line 12")

    engine.add_lora = broken
    try:
        err = error_of(s.load("breaks"), 503)
    finally:
        del engine.add_lora
    assert err["code"] == "worker_failure" and "worker d0" in err["message"] and "breaks" in err["message"]
    assert "secret" not in err["message"]
    lines = [r.getMessage() for r in caplog.records if "breaks" in r.getMessage()]
    # one line on the worker (why), one on the router (which worker), neither with a traceback
    assert any("worker d0" in m and "RuntimeError: secret internal detail" in m for m in lines), lines
    assert any("worker d0 did not load it" in m for m in lines), lines
    no_tracebacks(caplog)
    assert "breaks" not in s.models()


@pytest.mark.parametrize("name, words", [
    ("x" * 10_000, "got 10000 characters"),
    ("two\nlines", r"got '\n' in 'two\nlines'"),
    ("a b", "got ' ' in 'a b'"),
    ("tab\there", r"got '\t'"),
    ("nul\x00", r"got '\x00'"),
])
def test_bad_names_are_400s_naming_lora_name(lora_stack, name, words):
    s = lora_stack
    for r in (s.load(name), s.unload(name)):
        err = error_of(r, 400)
        assert err["param"] == "lora_name" and words in err["message"], err
        assert len(err["message"]) < 400, len(err["message"])  # the name is never echoed in full
    assert name not in s.models()


def test_the_cli_refuses_the_same_names_in_one_line(tmp_path):
    import argparse

    from splitserve.engine.args import add_engine_args
    from splitserve.engine.lora.args import lora_problem

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    for name, words in (("two\nlines", r"got '\n'"), ("y" * 300, "got 300 characters"), ("ok/name@v1:2", None)):
        problem = lora_problem(ap.parse_args(["--enable-lora", "--lora-modules", f"{name}={tmp_path}/none"]))
        if words is None:  # a good name: the next check speaks (the directory)
            assert problem == f"LoRA adapter '{name}': {tmp_path}/none is not a directory"
        else:
            assert problem.startswith("--lora-modules: a LoRA adapter name must be 1 to 256 characters from "
                                      "A-Z a-z 0-9 . _ : / @ + -") and words in problem and "\n" not in problem



def test_serve_refuses_an_admin_key_equal_to_the_api_key_before_ray_starts():
    """One line, exit 2, before any worker process: not a router failing after Ray came up."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--api-key", "same-key",
                          "--admin-api-key", "same-key"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "splitserve serve: --admin-api-key must differ from --api-key (the API key would then grant admin calls)"]
    assert "Ray" not in run.stdout + run.stderr

def test_load_and_unload_take_the_admin_key_not_the_api_key(lora_stack):
    s = lora_stack
    for call in (lambda **kw: s.load("guarded", **kw), lambda **kw: s.unload("boot", **kw)):
        err = error_of(call(key=KEY), 403)
        assert err["type"] == "permission_error" and err["code"] == "insufficient_permissions", err
        assert "--admin-api-key" in err["message"]
        assert error_of(call(key=None), 401)["code"] == "invalid_api_key"
        assert error_of(call(key="sk-wrong"), 401)["code"] == "invalid_api_key"
        assert error_of(call(key=ADMIN + "x"), 401)["code"] == "invalid_api_key"
    # the admin key opens nothing else: completions still take the API key
    assert error_of(s.post("/v1/completions", {"model": SERVED, "prompt": "hi"}, key=ADMIN), 401)
    # --api-key without --admin-api-key: nobody may (the API key never grants it)
    err = error_of(s.load("guarded", key=KEY, server="key-only"), 403)
    assert "this server has none" in err["message"]
    assert s.models() == ["boot"]
    r = s.load("guarded")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'guarded' added successfully."
    assert s.models() == ["boot", "guarded"]
    r = s.unload("guarded")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'guarded' removed successfully."
    # no key at all (a development server): open, as everything on it is
    assert s.load("dev", key=None, server="open").status_code == 200
    assert s.unload("dev", key=None, server="open").status_code == 200
    assert s.models() == ["boot"]


def sse_events(r: requests.Response) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in r.iter_lines() if line.startswith(b"data: ")]


def test_a_request_routed_just_before_the_unload_reached_the_worker_is_a_404_not_a_200(lora_stack, caplog):
    """The worker no longer has the adapter while the router still lists it (as it does for a
    request it routed just before the unload got there): 404 model_not_found, also when
    streaming (the 200 waits for the worker's first reply) and with n=2."""
    s = lora_stack
    assert s.load("racer").status_code == 200
    salt = s.server.loras.adapters()["racer"]
    assert s.run(s.decode.engine.remove_lora("racer")) is True  # the worker's half of the unload
    s.server.loras._record("d0", "racer", salt)  # the router's view from before it: still loaded
    try:
        assert "racer" in s.models()
        for stream, n in ((False, 1), (True, 1), (True, 2), (False, 2)):
            err = error_of(s.complete("racer", stream=stream, n=n), 404)
            assert err == {"message": err["message"], "type": "not_found_error", "param": "model",
                           "code": "model_not_found"}, (stream, n, err)
            assert "'racer' does not exist" in err["message"]
    finally:
        s.server.loras._record("d0", "racer", None)
    for model in ("boot", SERVED):  # a served adapter (its 200 held) and the base model still stream
        ok = s.complete(model, stream=True)
        events = sse_events(ok)
        assert ok.status_code == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]), events
    no_tracebacks(caplog)


def test_requests_during_an_unload_get_404_up_front(lora_stack):
    """From the moment an unload starts (the workers take a while here) the adapter is
    no longer served: requests for it get the router's 404, /v1/models leaves it out, and
    a load of that name meanwhile is a 409."""
    s = lora_stack
    assert s.load("leaving").status_code == 200
    engine = s.decode.engine
    real = engine.remove_lora
    started = threading.Event()

    async def slow(name):
        started.set()
        await asyncio.sleep(1.0)
        return await real(name)

    engine.remove_lora = slow
    try:
        with ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(s.unload, "leaving")
            assert started.wait(10)
            assert "leaving" not in s.models()
            for stream in (False, True):
                assert error_of(s.complete("leaving", stream=stream), 404)["code"] == "model_not_found"
            err = error_of(s.load("leaving"), 409)
            assert err["code"] == "lora_busy" and err["param"] == "lora_name"
            assert unloading.result(10).status_code == 200
    finally:
        del engine.remove_lora
    assert "leaving" not in s.models()
    assert error_of(s.complete("leaving"), 404)["code"] == "model_not_found"


def resident_series(s: LoRAStack) -> dict[str, float]:
    """splitserve_lora_resident of d0, as its /metrics serves it: adapter -> value."""
    text = requests.get(s.decode.admin_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("splitserve_lora_resident{") and 'worker="d0"' in line:
            adapter = line.split('adapter="', 1)[1].split('"', 1)[0]
            out[adapter] = float(line.rsplit(" ", 1)[1])
    return out


def test_residency_metrics_match_v1_models_after_a_storm(lora_stack):
    s = lora_stack
    names = ["s1", "s2", "s3", "s4"]

    def cycle(name: str) -> list[tuple[str, int, list]]:
        seen = []
        for _ in range(3):
            r = s.load(name)
            seen.append(("load", r.status_code, []))
            with ThreadPoolExecutor(3) as pool:
                streams = [pool.submit(s.complete, name, True) for _ in range(2)]
                gone = pool.submit(s.unload, name)
                for f in streams:
                    r = f.result()
                    seen.append(("stream", r.status_code, sse_events(r) if r.status_code == 200 else r.json()))
                seen.append(("unload", gone.result().status_code, []))
        return seen

    with ThreadPoolExecutor(len(names)) as pool:
        results = [x for seen in pool.map(cycle, names) for x in seen]
    for kind, status, body in results:
        if kind == "stream":  # a full answer, or refused before any 200: never an error event
            assert status in (200, 404), (status, body)
            if status == 200:
                assert body[-1] == "[DONE]" and not any("error" in e for e in body[:-1]), body
                assert "".join(e["choices"][0]["text"] for e in body[:-1] if e["choices"]), body
            else:
                assert body["error"]["code"] == "model_not_found", body
        else:
            assert status == 200, (kind, status)
    # the end state: three adapters loaded, two used (each took a slot; --max-loras 2)
    for name in ("s1", "s2"):
        assert s.load(name).status_code == 200
        assert s.complete(name).status_code == 200
    assert s.models() == ["boot", "s1", "s2"]
    deadline = time.monotonic() + 10
    while True:
        resident = resident_series(s)
        if sorted(resident) == s.models() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(resident) == s.models(), resident  # unloaded adapters have no series left
    assert resident["s1"] == resident["s2"] == 1.0 and resident["boot"] == 0.0, resident
    assert sum(resident.values()) <= 2
    for name in ("s1", "s2"):
        assert s.unload(name).status_code == 200
    assert sorted(resident_series(s)) == s.models() == ["boot"]
