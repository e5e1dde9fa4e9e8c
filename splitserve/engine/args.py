"""Engine command-line flags, shared by `serve`, `decode-worker` and `prefill-pool`."""

from __future__ import annotations

import argparse
import dataclasses

from splitserve.core.cli_types import positive_int
from splitserve.core.compatibility import refusal
from splitserve.core.expert_parallel import expert_parallel_problem
from splitserve.core.hashing import DEFAULT_BLOCK_SIZE
from splitserve.core.hybrid import hybrid_problem
from splitserve.core.model_config import CheckpointError, shardable_problem
from splitserve.core.model_dir import resolve_model as core_resolve_model
from splitserve.core.model_dir import served_config
from splitserve.core.quantization import (
    QUANTIZATION_CHOICES,
    quantization_from_config,
    tensor_parallel_split_problem,
)
from splitserve.core.speculative import SpeculativeConfigError, parse_speculative_config
from splitserve.engine.config import EngineConfig, checkpoint_is_quantized
from splitserve.engine.kv_cache import KV_CACHE_DTYPES
from splitserve.engine.kv_offload.args import add_kv_offload_args, kv_offload_fields
from splitserve.engine.lora.args import add_lora_args, lora_fields

DEFAULT_STEP_TOKENS = 2048
# A CPU decode worker's step while streams decode: a prefill chunk holds every stream's next
# token for as long as it takes (SmolLM2-135M: ~1 ms a prompt token on one core), and a remote
# prefill waits that long for its KV blocks to be reserved. 2048 tokens were ~2.3 s; 512 cut
# the default layout's mean TTFT at concurrency 8 from 5.0 to 3.5 s at the same tokens/s.
# With no stream decoding a prompt takes the whole budget (chunks would only add steps).
CPU_DECODE_STEP_TOKENS = 512


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the random-weight demo model)")
    g.add_argument("--served-model-name", help="model name clients send; seeds the block-hash space "
                                               "(must be the same on router and workers; default: directory name)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quantization", choices=list(QUANTIZATION_CHOICES),
                   help="the checkpoint's quantization, detected from config.json's quantization_config (or a "
                        ".gguf file); given, it must match, else serve refuses in one line. Weight-only, "
                        "activations in --dtype, except as --fp8-activations says (docs/architecture.md, "
                        "Quantized checkpoints)")
    g.add_argument("--fp8-activations", choices=["auto", "on", "off"], default="auto",
                   help="FP8 weights with a scale per row (or tensor) multiply FP8 activations, quantized per "
                        "token, on FP8 tensor cores (torch._scaled_mm), as vLLM does; auto: on a CUDA GPU of "
                        "compute capability 8.9+ (Ada, Hopper), matmuls of more than 4 rows (decode batches of "
                        "1-4 stay weight-only); on: every matmul; off: decoded to --dtype (the exact "
                        "weight-only result) (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks per worker (default: from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB of KV cache per worker")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type: auto = the model's --dtype; fp8 (= fp8_e4m3) stores e4m3 codes "
                        "with per-layer scales (1.0 unless the checkpoint ships k_scale/v_scale): twice the "
                        "tokens of bf16 in the same memory, half the bytes per KV transfer. Prefill and decode "
                        "workers must agree")
    g.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=1,
                   help="shard the model over this many rank processes (gloo on CPU, NCCL on CUDA; "
                        "docs/architecture.md, Tensor parallelism). KV moves between workers of any TP "
                        "sizes (re-sharded by KV heads on arrival) over --kv-backend grpc")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="spread a mixture-of-experts model's experts whole over the --tensor-parallel-size ranks "
                        "(E/N each), tokens sent to their experts' ranks and back by all-to-all, instead of a "
                        "slice of every expert on every rank (vLLM's flag; docs/architecture.md, Expert "
                        "parallelism). Needs -tp > 1 and an MoE model whose expert count N divides")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=positive_int,
                   help=f"token budget of one engine step, prefill chunks and decodes together (default: "
                        f"{DEFAULT_STEP_TOKENS}; on a CPU decode worker {CPU_DECODE_STEP_TOKENS} in steps where its "
                        "streams decode: docs/architecture.md, \"Step budget of a CPU decode worker\"); given, "
                        "it applies to every step of every worker")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--torch-threads", type=positive_int, help="intra-op CPU threads of each engine (default: the CPUs "
                   "this process may use, i.e. its affinity set capped by the container's CPU limit, less "
                   "one left to the serving threads when there are two or more; `serve` splits them among "
                   "its workers, see --cpus)")
    add_kv_offload_args(g)
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly on CUDA (by default they replay CUDA graphs; off on CPU)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="overlap pure-decode steps: the next step is scheduled and launched while the previous "
                        "one's tokens are still on the device, its outputs processed after (vLLM's flag; same "
                        "tokens; a step that may draft runs ordinarily). Off by default "
                        "until measured on a GPU (docs/gpu.md)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON object, e.g. {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} '
                        '(optional "disable_by_batch_size": N); docs/architecture.md, Speculative decoding')
    g.add_argument("--no-warm-up", action="store_true",
                   help="skip the start-up warm-up on CUDA (two throwaway requests that compile the kernels "
                        "before the first real one; off on CPU)")
    add_lora_args(g)


def speculative_problem(args: argparse.Namespace) -> str | None:
    """Why --speculative-config cannot be served (one line), or None; checked before any process starts."""
    try:
        parse_speculative_config(getattr(args, "speculative_config", None), args.model)
    except SpeculativeConfigError as exc:
        return f"--speculative-config: {exc}"
    return None


def flag_features(args: argparse.Namespace) -> set[str]:
    """The core/compatibility.py features these flags turn on, as EngineConfig.features sees
    them (the command line cannot force CUDA graphs on: by default they go off where refused),
    plus Mooncake from --kv-backend."""
    try:
        spec = parse_speculative_config(getattr(args, "speculative_config", None), check_files=False)
    except SpeculativeConfigError:  # speculative_problem says why
        spec = None
    method = spec.method if spec is not None else None
    on = {"tensor-parallel": getattr(args, "tensor_parallel_size", 1) > 1,
          "expert-parallel": getattr(args, "enable_expert_parallel", False),
          "lora": getattr(args, "enable_lora", False), "async-scheduling": getattr(args, "async_scheduling", False),
          "ngram": method == "ngram", "draft-model": method == "draft_model", "mtp": method == "mtp",
          "kv-offload-host": getattr(args, "kv_offload_gib", 0.0) > 0,
          "kv-offload-disk": getattr(args, "kv_offload_dir", None) is not None,
          "mooncake": getattr(args, "kv_backend", "grpc") == "mooncake",
          "fp8-kv-cache": getattr(args, "kv_cache_dtype", "auto").startswith("fp8"),
          "quantized": checkpoint_is_quantized(getattr(args, "model", None), getattr(args, "quantization", None))}
    return {feature for feature, yes in on.items() if yes}


def compatibility_problem(args: argparse.Namespace, prefill_role: bool = False) -> str | None:
    """The features these flags combine that the table refuses (core/compatibility.py: the
    line EngineConfig, the operator and the CRD refuse them with), or None; checked before any
    process starts by `serve` and every worker's main, which exit 2 with it. A hybrid model's
    own limits (core/hybrid.py) after: `prefill_role` for the prefill worker and pool."""
    features = flag_features(args)
    why = refusal(features)
    if why is None and getattr(args, "model", None) is not None:
        prefill = 1 if prefill_role else getattr(args, "prefill_workers", 0)
        why = hybrid_problem(served_config(args.model), features, prefill, getattr(args, "decode_workers", 1))
    return why


def async_scheduling_problem(args: argparse.Namespace) -> str | None:
    """--async-scheduling's own constraint (EngineConfig's, one line): it runs the padded
    (graph) decode step, so not with --no-cuda-graphs. Its pairs are the table's."""
    if getattr(args, "async_scheduling", False) and getattr(args, "no_cuda_graphs", False):
        return "--async-scheduling runs the padded (graph) decode step: it cannot run with --no-cuda-graphs"
    return None


def tensor_parallel_problem(args: argparse.Namespace) -> str | None:
    """Why this checkpoint cannot be split over --tensor-parallel-size ranks, or None (which
    features combine with tensor parallelism is compatibility_problem's); with
    --enable-expert-parallel, why its experts cannot be spread over them."""
    if getattr(args, "enable_expert_parallel", False):
        why = expert_parallel_problem(served_config(getattr(args, "model", None)), args.tensor_parallel_size)
        if why:
            return f"--enable-expert-parallel: {why}"
    cfg = served_config(getattr(args, "model", None)) if args.tensor_parallel_size > 1 else None
    why = shardable_problem(cfg, args.tensor_parallel_size) if cfg is not None else None
    if cfg is not None and not why:
        try:
            spec = quantization_from_config(cfg.raw)
        except CheckpointError:  # checkpoint_problem says why
            spec = None
        why = tensor_parallel_split_problem(spec, cfg, args.tensor_parallel_size,
                                            getattr(args, "enable_expert_parallel", False))
    if why:  # the ranks would refuse it after Ray and the rank processes started (issue 49)
        return f"--tensor-parallel-size {args.tensor_parallel_size}: {cfg.architecture} cannot be split that way: {why}"
    return None


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(checkpoint dir, served name); builds the demo checkpoint when no --model is given."""
    if args.model is None:
        from splitserve.engine.demo import ensure_demo_checkpoint

        ensure_demo_checkpoint()
    return core_resolve_model(args)


def engine_config_from_args(args: argparse.Namespace, model: str, served: str) -> EngineConfig:
    return EngineConfig(model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=int(args.kv_cache_memory * 2**30),
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_STEP_TOKENS,
                        max_model_len=args.max_model_len, model_id=served,
                        quantization=getattr(args, "quantization", None),
                        fp8_activations={"on": True, "off": False}.get(getattr(args, "fp8_activations", "auto")),
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                        cuda_graphs=False if getattr(args, "no_cuda_graphs", False) else None,
                        async_scheduling=getattr(args, "async_scheduling", False),
                        warm_up=False if getattr(args, "no_warm_up", False) else None, **kv_offload_fields(args),
                        speculative_config=getattr(args, "speculative_config", None), **lora_fields(args))


def decode_worker_engine(engine: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """A decode worker's engine config: on a CPU, steps of CPU_DECODE_STEP_TOKENS while its
    streams decode, unless --max-num-batched-tokens was given (a prompt with no stream to hold
    up, and prefill workers' steps, keep the whole budget)."""
    if args.max_num_batched_tokens is not None or not str(engine.device).startswith("cpu"):
        return engine
    return dataclasses.replace(engine, decoding_step_tokens=CPU_DECODE_STEP_TOKENS)
