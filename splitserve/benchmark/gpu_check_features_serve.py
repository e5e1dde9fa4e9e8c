"""The features stage's serve-driven sub-checks (gpu_check_features.py runs them): spec_serve and
lora_serve, each through `splitserve serve` with 1 prefill + 1 decode worker, and the helpers only
they use: the server's lifetime (`serving`), one completion, and a concurrent load through it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

# one way only: this module takes the shared helpers at import, gpu_check_features imports it when a check runs
from splitserve.benchmark.gpu_check_features import (
    ADAPTER,
    NGRAM,
    Env,
    Failed,
    copy_heavy,
    random_ids,
    verdict_of,
    write_adapter,
)
from splitserve.benchmark.gpu_check_serve import SERVED, Server, metric_sums

MIN_UNCACHED = 48  # prompts longer than this go to the prefill worker; shorter ones stay on the decode worker
SPEC = ("splitserve_spec_decode_num_drafts_total", "splitserve_spec_decode_num_draft_tokens_total",
        "splitserve_spec_decode_num_accepted_tokens_total")


@contextmanager
def serving(env: Env, row: dict, name: str, extra: list[str]):
    """`splitserve serve` (1 prefill + 1 decode worker) for the block; after it, the server must
    have shut down on Ctrl-C with no traceback in its log."""
    args = ["--model", env.model, "--device", env.device, "--dtype", env.serve_dtype, "--prefill-workers", "1",
            "--decode-workers", "1", "--disagg-min-uncached-tokens", str(MIN_UNCACHED), "--strict-disaggregation",
            *extra]
    server = Server(args, env.workdir / f"features_{name}.log")
    row["command"] = " ".join(server.command[2:])
    try:
        started = time.monotonic()
        if not server.wait_ready(env.start_timeout):
            raise Failed(f"serve did not start in {env.start_timeout:.0f} s: " + "".join(server.lines[-20:])[-1500:])
        row["startup_seconds"] = round(time.monotonic() - started, 1)
        yield server
    finally:
        row["serve_exit_code"] = code = server.stop()
    log = "".join(server.lines)
    if code is None:
        raise Failed("serve did not shut down within 90 s of Ctrl-C")
    if "Traceback" in log:
        raise Failed("a traceback in serve's log: " + log[log.find("Traceback"):][:1500])


def complete(base_url: str, model: str, prompt: list[int], new: int) -> dict | str:
    """One greedy completion: the response, or what went wrong."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = {**json.loads(r.read()), "workers": r.headers.get("x-splitserve-workers", "")}
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"
    except Exception as exc:  # noqa: BLE001 - recorded as this request's failure
        return repr(exc)
    return out if out["usage"]["completion_tokens"] == new else f"{out['usage']['completion_tokens']} tokens of {new}"


def fan_out(server: Server, row: dict, jobs: list[tuple[str, list[int]]], new: int) -> tuple[list, list[str]]:
    """Every (model, prompt) at concurrency 8: (responses, problems), figures into `row`. Each
    completed prompt of MIN_UNCACHED tokens or more must have been prefilled by the prefill
    worker, each shorter one by the decode worker (--strict-disaggregation)."""
    base_url, started = f"http://127.0.0.1:{server.port}", time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda job: complete(base_url, *job, new), jobs))
    seconds, failures = time.monotonic() - started, [o for o in outs if isinstance(o, str)]
    done = [(len(p) >= MIN_UNCACHED, "prefill=prefill" in o["workers"]) for (_, p), o in zip(jobs, outs, strict=True)
            if isinstance(o, dict)]
    long, remote = sum(want for want, _ in done), sum(got for _, got in done)
    row.update(requests=len(jobs), completed=len(done), failures=failures[:3], long_prompts=long,
               prefilled_by_prefill_worker=remote, load_seconds=round(seconds, 2),
               output_tok_s=round(len(done) * new / seconds, 1))
    problems = [f"{len(failures)} of {len(jobs)} requests failed"] if failures else []
    if any(want != got for want, got in done):
        problems.append(f"{remote} prompts prefilled by the prefill worker, {long} expected (the long ones)")
    return outs, problems


def spec_serve(env: Env, row: dict) -> str:
    prompts = [copy_heavy(100 + i, 24 if i % 2 else 8) for i in range(env.requests)]  # 84 / 28 tokens
    with serving(env, row, "spec", ["--speculative-config", json.dumps(NGRAM)]) as server:
        _, problems = fan_out(server, row, [(SERVED, p) for p in prompts], env.new_tokens)
        url = server.worker_metrics().get("decode")
        counters = metric_sums(url, SPEC) if url else {}
    drafts, drafted, accepted = (counters.get(name, 0.0) for name in SPEC)
    row.update(decode_worker_metrics=counters, acceptance_rate=round(accepted / drafted, 3) if drafted else None)
    if not url:
        problems.append("no decode worker metrics URL in serve's log")
    elif not (drafts and 0 < accepted <= drafted):
        problems.append(f"decode worker: {drafted:.0f} draft tokens proposed, {accepted:.0f} accepted")
    return verdict_of(problems, f"{len(prompts)} requests completed ({row['long_prompts']} disaggregated), "
                                f"{accepted:.0f} of {drafted:.0f} draft tokens accepted on the decode worker")


def lora_serve(env: Env, row: dict) -> str:
    adapter = write_adapter(env.model, env.workdir / "features_lora_adapter")
    prompts = [random_ids(200 + i, 60 if i % 2 else 20) for i in range(env.requests // 2)]
    with serving(env, row, "lora", ["--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                                    f"{ADAPTER}={adapter}"]) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=10) as r:
            listed = [m["id"] for m in json.loads(r.read())["data"]]
        jobs = [(model, p) for p in prompts for model in (ADAPTER, SERVED)]
        outs, problems = fan_out(server, row, jobs, env.new_tokens)
    texts = [o["choices"][0]["text"] if isinstance(o, dict) else None for o in outs]
    changed = sum(a != b for a, b in zip(texts[::2], texts[1::2], strict=True) if a is not None and b is not None)
    row.update(models_listed=listed, prompts=len(prompts), prompts_changed_by_adapter=changed)
    if ADAPTER not in listed:
        problems.append(f"/v1/models lists {listed}, not {ADAPTER}")
    if not changed:
        problems.append("the adapter changed no prompt's output")
    return verdict_of(problems, f"{len(jobs)} requests completed (adapter and base), the adapter changed "
                                f"{changed} of {len(prompts)} outputs")
