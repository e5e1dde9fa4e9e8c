"""Command-line options of `splitserve bench` and their validation. Every bad value
ends in an argparse error naming the option and what to write instead."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from splitserve.benchmark.arrivals import ARRIVAL_KINDS
from splitserve.benchmark.client import ClientConfig
from splitserve.benchmark.metrics import SLO_METRICS
from splitserve.benchmark.runner import RunConfig
from splitserve.benchmark.workloads import WORKLOADS, WorkloadConfig

DEFAULT_NUM_PROMPTS = 100


def length_range(text: str) -> tuple[int, int]:
    """`128` or `64:256` (inclusive)."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH (integers), got {text!r}") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def request_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second or 'inf', got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text!r}")
    return rate


def rate_list(text: str) -> list[float]:
    rates = [request_rate(part.strip()) for part in text.split(",") if part.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("expected comma-separated rates such as 1,2,4,inf")
    return rates


def percentile_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 50,90,99, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be within (0, 100], got {text!r}")
    return sorted(set(values))


def goodput_slos(items: list[str]) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r} in {item!r}; "
                             f"use {', '.join(m + ':MS' for m in SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} needs a number of milliseconds, e.g. {name}:500") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput: the {name} limit must be a positive number of ms, got {value!r}")
        if name in slos:
            raise ValueError(f"--goodput: {name} is given twice")
        slos[name] = ms
    return slos


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve bench", description=(
        "Load-test an OpenAI-compatible server (splitserve, vLLM, SGLang, ...) and report "
        "TTFT, TPOT, ITL and end-to-end latency as vLLM's serving benchmark defines them."))
    t = p.add_argument_group("target")
    t.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (no /v1)")
    t.add_argument("--model", required=True, help="model name sent in each request")
    t.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--ignore-eos", action="store_true", help="ask the server to generate max_tokens")
    t.add_argument("--no-usage", action="store_true",
                   help="do not request stream_options.include_usage; count streamed chunks instead")
    t.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-prompts", type=int, help=f"requests, or sessions for multi-turn (default {DEFAULT_NUM_PROMPTS})")
    w.add_argument("--input-len", type=length_range, default=(128, 128),
                   help="N or LOW:HIGH prompt tokens, as the served model counts them (chat: after its template)")
    w.add_argument("--output-len", type=length_range, default=(64, 64), help="max_tokens, N or LOW:HIGH")
    w.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="auto: token ids for completions, words for chat and multi-turn")
    w.add_argument("--tokenizer", metavar="DIR",
                   help="size text prompts with the tokenizer.json (and chat template) in DIR; default: the "
                        "server's POST /tokenize (vLLM's API), so the served model's own tokenizer")
    w.add_argument("--token-id-range", type=length_range, default=(100, 1000),
                   help="random ids are drawn from [LOW, HIGH); keep it inside the model's vocabulary")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: shared prefixes")
    w.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: prefix tokens")
    w.add_argument("--suffixes-per-prefix", type=int, default=8, help="prefix-repetition: suffixes each")
    w.add_argument("--turns", type=int, default=3, help="multi-turn: turns per session")
    w.add_argument("--context-len", type=length_range, default=(3072, 3072),
                   help="long-context: N or LOW:HIGH; prompt + output must fit the model's context")
    w.add_argument("--long-fraction", type=float, default=1.0, help="long-context: share of long prompts")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=request_rate, help="sessions per second, or inf (default)")
    a.add_argument("--sweep-rates", type=rate_list, help="run once per rate, e.g. 1,2,4,inf")
    a.add_argument("--arrival", choices=ARRIVAL_KINDS, default="poisson")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    a.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    a.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--percentiles", type=percentile_list, default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=[],
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    o.add_argument("--result-file", type=Path, help="write the JSON results here")
    o.add_argument("--save-requests", action="store_true", help="include every request in the JSON")
    o.add_argument("--plot-dir", type=Path, help="write ttft_cdf.png (and latency_vs_rate.png) here")
    o.add_argument("--label", default="", help="a name for this run in plots and JSON")
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


@dataclass
class BenchOptions:
    client: ClientConfig
    workload: WorkloadConfig
    run: RunConfig
    rates: list[float]
    sweep: bool
    percentiles: list[float]
    slos_ms: dict[str, float]
    result_file: Path | None = None
    plot_dir: Path | None = None
    save_requests: bool = False
    label: str = ""
    tokenizer: str | None = None  # text prompts: a local tokenizer directory instead of the server's /tokenize


def _check_target(p: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, object]:
    url = urlparse(ns.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        p.error(f"--base-url must look like http://HOST:PORT, got {ns.base_url!r}")
    if url.path.rstrip("/").endswith("/v1") and ns.endpoint.startswith("/v1"):
        p.error(f"--base-url {ns.base_url!r} already ends in /v1 and --endpoint adds it again; "
                "drop /v1 from --base-url")
    if not ns.endpoint.rstrip("/").endswith("completions"):
        p.error(f"--endpoint must be /v1/completions or /v1/chat/completions, got {ns.endpoint!r}")
    if not ns.request_timeout > 0:
        p.error(f"--request-timeout must be > 0 seconds, got {ns.request_timeout}")
    if ns.temperature < 0:
        p.error(f"--temperature must be >= 0, got {ns.temperature}")
    try:
        extra = json.loads(ns.extra_body)
    except ValueError as exc:
        p.error(f"--extra-body is not valid JSON ({exc}): {ns.extra_body!r}")
    if not isinstance(extra, dict):
        p.error("--extra-body must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return extra


def parse_args(argv: list[str]) -> BenchOptions:
    p = build_parser()
    ns = p.parse_args(argv)
    extra = _check_target(p, ns)
    client = ClientConfig(base_url=ns.base_url, model=ns.model, endpoint=ns.endpoint,
                          api_key=ns.api_key, temperature=ns.temperature,
                          ignore_eos=ns.ignore_eos, include_usage=not ns.no_usage,
                          timeout_s=ns.request_timeout, extra_body=extra)
    fmt = ns.prompt_format
    if fmt == "auto":
        fmt = "text" if client.is_chat or ns.workload == "multi-turn" else "ids"
    if fmt == "ids" and client.is_chat:
        p.error("chat endpoints take text messages: use --prompt-format text (or auto)")
    if fmt == "ids" and ns.workload == "multi-turn":
        p.error("multi-turn sessions carry answers as text: use --prompt-format text (or auto)")
    num_prompts = ns.num_prompts if ns.num_prompts is not None else DEFAULT_NUM_PROMPTS
    if ns.workload == "prefix-repetition":
        pairs = ns.num_prefixes * ns.suffixes_per_prefix
        if ns.num_prompts is not None and ns.num_prompts != pairs:
            p.error(f"prefix-repetition sends --num-prefixes x --suffixes-per-prefix = {pairs} "
                    f"requests; drop --num-prompts {ns.num_prompts} or make it {pairs}")
        num_prompts = pairs
    workload = WorkloadConfig(
        kind=ns.workload, num_prompts=num_prompts, input_len=ns.input_len,
        output_len=ns.output_len, prompt_format=fmt, token_id_range=ns.token_id_range,
        num_prefixes=ns.num_prefixes, prefix_len=ns.prefix_len,
        suffixes_per_prefix=ns.suffixes_per_prefix, turns=ns.turns,
        context_len=ns.context_len, long_fraction=ns.long_fraction, seed=ns.seed)
    try:
        workload.validate()
    except ValueError as exc:  # name the option, not the dataclass field
        p.error(re.sub(r"\b([a-z]+(?:_[a-z]+)+)\b",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(exc)))
    try:
        slos = goodput_slos(ns.goodput)
    except ValueError as exc:
        p.error(str(exc))
    if ns.sweep_rates and ns.request_rate is not None:
        p.error("give either --request-rate or --sweep-rates, not both")
    if not ns.burstiness > 0 or math.isinf(ns.burstiness):
        p.error(f"--burstiness must be a positive number, got {ns.burstiness}")
    if ns.arrival == "constant" and ns.burstiness != 1.0:
        p.error("--burstiness shapes Poisson/gamma arrivals; it has no meaning with --arrival constant")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    rates = ns.sweep_rates or [ns.request_rate if ns.request_rate is not None else math.inf]
    run = RunConfig(request_rate=rates[0], burstiness=ns.burstiness, arrival=ns.arrival,
                    max_concurrency=ns.max_concurrency, seed=ns.seed,
                    progress=not ns.no_progress)
    return BenchOptions(client=client, workload=workload, run=run, rates=rates,
                        sweep=bool(ns.sweep_rates), percentiles=ns.percentiles, slos_ms=slos,
                        result_file=ns.result_file, plot_dir=ns.plot_dir,
                        save_requests=ns.save_requests, label=ns.label, tokenizer=ns.tokenizer)
