"""A trained gpt-oss-20b through `splitserve serve` on a lent GPU (issue 52), ~5-8 minutes:
1. serve disaggregated (1 prefill + 1 decode worker, bf16, MXFP4 experts as shipped; decode
   steps run eagerly: gpt-oss's experts are not captured in CUDA graphs);
2. harmony chat through the `openai` client (bench/gpu/gpt_oss_chat.py): reasoning_effort low /
   medium / high, a function tool the model should call, a tool-result follow-up, streamed and
   not, and responses.create once; every answer's fields checked;
3. greedy agreement: the first 32 tokens serve generates for 4 harmony prompts against
   transformers loading the same checkpoint (Mxfp4Config(dequantize=True), bf16, the GPU), the
   matched prefix per prompt reported (bf16 on other kernels is not bit-exact: not asserted).
   serve returns text, not ids: a position matches when its token's text (`logprobs`) is the
   text of transformers' token there;
4. output tok/s of `splitserve bench` at concurrency 1 and 8, 256-token prompts, 128 out.
The checkpoint (~13 GB) cannot be carried to a lent machine (64 MiB) nor downloaded there (no
hub): run this where it is on disk, e.g. a mounted model volume or an HF cache snapshot.
    python bench/gpu/gpt_oss_20b.py OUTDIR --model DIR   # a GPU with >= 70 GiB
    ... --part serve, then --part reference               # the same as two commands (each under 600 s)
    python bench/gpu/gpt_oss_20b.py OUTDIR --dry-run     # the same on the CPU: a tiny random gpt-oss
                                                         # (MXFP4 as shipped, the real harmony vocab)
Writes OUTDIR/gpt_oss_20b.json after every part. Exit 0: every counted check passed; 1: one
failed; 2: it cannot run here (no checkpoint, no CUDA, a missing package), said in one line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/gpu/gpt_oss_chat.py; the dry run's checkpoint writers (tests/)
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from gpt_oss_chat import run_chat  # noqa: E402

from splitserve.benchmark.gpu_check_serve import SERVED, Server  # noqa: E402

GPU = dict(dtype="bfloat16", chat_tokens=1024, greedy_tokens=32, input_len=256, output_len=128, prompts=(4, 16),
           start_timeout=480.0, serve=["--kv-cache-memory", "4", "--max-model-len", "8192"])
DRY = dict(dtype="float32", chat_tokens=8, greedy_tokens=8, input_len=32, output_len=4, prompts=(2, 8),
           start_timeout=150.0, serve=["--num-kv-blocks", "128"])
GREEDY_PROMPTS = ["Explain in one sentence why the sky is blue.", "Write a haiku about disaggregated serving.",
                  "What is the capital of Norway?", "List three uses of a paperclip."]


def unavailable(why: str) -> None:
    print(f"gpt_oss_20b: {why}", file=sys.stderr)
    raise SystemExit(2)


def preflight(model: Path | None, dry: bool) -> None:
    """One line and exit 2 for whatever keeps this from running here."""
    for module in ("openai", "openai_harmony"):
        try:
            __import__(module)
        except ImportError:
            unavailable(f"the {module} package is not importable (bench/gpu/pack_deps.sh packs it)")
    from splitserve.core.harmony_vocab import VocabUnavailable, use_offline_vocab

    try:
        use_offline_vocab()  # serve inherits TIKTOKEN_ENCODINGS_BASE
    except VocabUnavailable as exc:
        unavailable(str(exc))
    if dry:
        return
    if model is None or not (model / "config.json").is_file():
        unavailable(f"no gpt-oss-20b checkpoint at {model or '(no --model)'}: it is ~13 GB and cannot be carried to "
                    "or downloaded on a lent GPU; pass --model DIR where it is on disk (or --dry-run on the CPU)")
    arch = json.loads((model / "config.json").read_text()).get("architectures")
    if arch != ["GptOssForCausalLM"]:
        unavailable(f"{model} is {arch}, not a GptOssForCausalLM checkpoint")
    import torch

    if not torch.cuda.is_available():
        unavailable("no CUDA device (run --dry-run on the CPU)")
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if gib < 70:  # two workers of ~26 GB (experts as FP8 codes, 1.125 B a value), then transformers' 42 GB bf16
        unavailable(f"the GPU has {gib:.0f} GiB; serve's two workers and then transformers need about 70")


def device_name(dry: bool) -> str:
    if dry:
        return "cpu-dry-run"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown GPU"


def dry_checkpoint(root: Path) -> Path:
    """A tiny random gpt-oss (tests/engine/test_gpt_oss.py's shape: sinks, an 8-token window, 8
    experts) with gpt-oss's real tokenizer (o200k + the harmony specials, tests/helpers), its
    experts in the shipped MXFP4 layout (tests/engine/test_gpt_oss_mxfp4.py's writer); built once."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from splitserve.engine.demo import build_checkpoint_once
    from tests.engine.test_gpt_oss import CONFIG
    from tests.engine.test_gpt_oss_mxfp4 import write_mxfp4_twin
    from tests.helpers.harmony_tokenizer import EOS_IDS, VOCAB_SIZE, write_harmony_tokenizer

    def write(out: Path) -> None:
        cfg = GptOssConfig(vocab_size=VOCAB_SIZE, architectures=["GptOssForCausalLM"], bos_token_id=199998,
                           eos_token_id=EOS_IDS, pad_token_id=199999, **CONFIG)
        torch.manual_seed(5)
        model = GptOssForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
        with tempfile.TemporaryDirectory() as work:
            model.save_pretrained(f"{work}/float")
            write_harmony_tokenizer(Path(work) / "float")
            for f in write_mxfp4_twin(Path(work) / "float", Path(work) / "mxfp4").iterdir():
                shutil.move(str(f), out / f.name)

    return build_checkpoint_once(root, write)


def greedy_prompts() -> list[list[int]]:
    from splitserve.router import harmony

    return [harmony.render([{"role": "user", "content": p}], reasoning_effort="low", start_date="2026-01-01")
            for p in GREEDY_PROMPTS]


def serve_greedy(base_url: str, prompts: list[list[int]], n: int) -> list[list[str]]:
    """Each prompt's first n tokens from serve (greedy, EOS ignored), as the tokens' texts."""
    import urllib.request

    out = []
    for prompt in prompts:
        body = json.dumps({"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                           "logprobs": 0, "skip_special_tokens": False}).encode()
        req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
        out.append(json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]["logprobs"]["tokens"])
    return out


def transformers_greedy(model: Path, prompts: list[list[int]], n: int, dry: bool) -> list[list[str]]:
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from splitserve.core.tokenizer import Tokenizer

    kw = dict(dtype=torch.float32) if dry else dict(dtype=torch.bfloat16, device_map="cuda")
    hf = AutoModelForCausalLM.from_pretrained(str(model), quantization_config=Mxfp4Config(dequantize=True), **kw)
    tok, out = Tokenizer(model), []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=hf.device)
        with torch.no_grad():
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=199999)[0, len(prompt):].tolist()
        out.append([tok.decode([t], skip_special_tokens=False) for t in new])
    del hf
    return out


def agreement(ours: list[list[str]], theirs: list[list[str]]) -> list[int]:
    """Per prompt: how many leading tokens are the same."""
    return [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
            for x, y in zip(ours, theirs, strict=True)]


def throughput(base_url: str, workdir: Path, size: dict) -> dict:
    rows = {}
    for concurrency, prompts in zip((1, 8), size["prompts"], strict=True):
        result = workdir / f"bench_c{concurrency}.json"
        cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--base-url", base_url, "--model", SERVED,
               "--num-prompts", str(prompts), "--input-len", str(size["input_len"]), "--output-len",
               str(size["output_len"]), "--ignore-eos", "--max-concurrency", str(concurrency),
               "--token-id-range", "1000:190000", "--result-file", str(result), "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode or not result.exists():
            rows[f"concurrency_{concurrency}"] = {"ok": False, "error": (proc.stdout + proc.stderr)[-1500:]}
            continue
        run = json.loads(result.read_text())["runs"][0]
        rows[f"concurrency_{concurrency}"] = {
            "ok": run["completed"] == prompts and not run["failed"], "requests": prompts,
            "output_tok_per_s": round(run["output_throughput"], 2), "ttft_ms_p50": run["ttft_ms"].get("p50"),
            "tpot_ms_p50": run["tpot_ms"].get("p50"), "completed": run["completed"], "failed": run["failed"]}
    return {"ok": all(r["ok"] for r in rows.values()), **rows}


def serve_part(report: dict, model: Path, size: dict, dry: bool, outdir: Path, save) -> None:
    """serve up, the chat checks, serve's greedy tokens and the throughput, serve stopped."""
    flags = ["--model", str(model), "--device", "cpu" if dry else "cuda", "--dtype", size["dtype"],
             "--prefill-workers", "1", "--decode-workers", "1", "--disagg-min-uncached-tokens", "16",
             *([] if dry else ["--no-cuda-graphs"]), *size["serve"]]
    server = Server(flags, outdir / "gpt_oss_20b_serve.log")
    report["serve_command"] = " ".join(server.command[2:])
    try:
        started = time.monotonic()
        if not server.wait_ready(size["start_timeout"]):
            report["serve"] = {"ok": False, "reason": f"serve did not start in {size['start_timeout']:.0f} s",
                               "log_tail": "".join(server.lines[-30:])[-3000:]}
            return
        base = f"http://127.0.0.1:{server.port}"
        report["serve"] = {"ok": True, "startup_s": round(time.monotonic() - started, 1)}
        save()
        report["chat"] = run_chat(base, SERVED, size["chat_tokens"], trained=not dry)
        save()
        report["greedy_vs_transformers"] = {"tokens": size["greedy_tokens"], "ok": True,
                                            "serve": serve_greedy(base, greedy_prompts(), size["greedy_tokens"])}
        report["throughput"] = throughput(base, outdir, size)
    finally:
        report.setdefault("serve", {})["exit_code"] = code = server.stop()
        if code != 0:
            report["serve"].update(ok=False, reason=report["serve"].get("reason") or f"serve exited {code}")
        save()


def reference_part(report: dict, model: Path, dry: bool) -> None:
    """transformers' greedy tokens for the same prompts, and the matched prefix per prompt."""
    greedy = report.get("greedy_vs_transformers")
    if not greedy or "serve" not in greedy:
        report["greedy_vs_transformers"] = {"ok": False, "reason": "no serve tokens to compare (run --part serve)"}
        return
    n = greedy["tokens"]
    greedy["transformers"] = transformers_greedy(model, greedy_prompts(), n, dry)
    greedy["matched_prefix"] = matched = agreement(greedy["serve"], greedy["transformers"])
    # float32 on the CPU must agree exactly; bf16 on other kernels is reported, not asserted
    greedy.update(ok=not dry or all(m == n for m in matched), counted=dry)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--model", type=Path, help="the gpt-oss-20b checkpoint directory (config.json, *.safetensors)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, a tiny random gpt-oss (float32, few tokens)")
    ap.add_argument("--part", choices=("all", "serve", "reference"), default="all",
                    help="serve: everything but transformers; reference: transformers against the serve tokens "
                         "already in OUTDIR/gpt_oss_20b.json (two commands under a per-command time limit)")
    args = ap.parse_args(argv)
    preflight(args.model, args.dry_run)
    size = DRY if args.dry_run else GPU
    args.outdir.mkdir(parents=True, exist_ok=True)
    model = (dry_checkpoint(Path(tempfile.gettempdir()) / "splitserve-gpt-oss-20b-dry-run-v1") if args.dry_run
             else args.model)
    out = args.outdir / "gpt_oss_20b.json"
    report: dict = json.loads(out.read_text()) if args.part == "reference" and out.is_file() else {
        "device": device_name(args.dry_run), "model": str(model), "dtype": size["dtype"],
        "mode": "CPU dry run: a tiny random gpt-oss, no GPU figure" if args.dry_run else "GPU",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save() -> None:
        out.write_text(json.dumps(report, indent=2) + "\n")

    if args.part in ("all", "serve"):
        serve_part(report, model, size, args.dry_run, args.outdir, save)
    if args.part in ("all", "reference") and report.get("serve", {}).get("exit_code") is not None:
        reference_part(report, model, args.dry_run)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["ok"] = all(report[k]["ok"] for k in ("serve", "chat", "throughput", "greedy_vs_transformers")
                       if k in report)
    save()
    print(json.dumps({k: report.get(k) for k in ("device", "ok")} | {"json": str(out)}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
