"""The engine's configuration: which checkpoint, dtype and device, and how the KV cache and
batches are sized. The checkpoint's own configuration is core/model_config.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from splitserve.core.compatibility import refusal
from splitserve.core.expert_parallel import expert_parallel_problem
from splitserve.core.gguf_model import find_gguf, prepare_gguf
from splitserve.core.hashing import DEFAULT_BLOCK_SIZE
from splitserve.core.hybrid import hybrid_problem
from splitserve.core.model_dir import served_config
from splitserve.core.speculative import SpeculativeConfig, parse_speculative_config
from splitserve.engine.kv_cache import kv_cache_torch_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 (= fp8_e4m3): e4m3 codes, engine/kv_cache.py
    max_num_seqs: int = 64  # most sequences in one batch
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    # the budget of a step in which streams decode (a prefill chunk holds their next tokens);
    # None: max_num_batched_tokens. CPU decode workers: engine/args.py decode_worker_engine
    decoding_step_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own limit
    enable_prefix_caching: bool = True
    quantization: str | None = None  # --quantization: must match the checkpoint's (core/quantization.py)
    # FP8 weights (a scale per row) times FP8 activations via torch._scaled_mm (kernels/fp8_scaled_mm.py):
    # True: every matmul; None (auto): on FP8 tensor cores (CUDA 8.9+), matmuls of more rows than a decode
    # batch's GEMV (prefill: compute-bound); False: weight-only, exact against dequantizing
    fp8_activations: bool | None = None
    model_id: str | None = None  # seeds the block-hash space; default: the directory name
    seed: int = 0  # seed of the generator used by unseeded sampled requests
    cuda_graphs: bool | None = None  # decode steps replayed from CUDA graphs; None: on for CUDA, off on CPU
    # pure-decode steps overlapped: step N+1 scheduled and launched while step N's tokens are
    # still on the device, its outputs processed after (engine/overlap.py; vLLM's --async-scheduling)
    async_scheduling: bool = False
    warm_up: bool | None = None  # throwaway requests at start-up compile the kernels (engine/warmup.py); None: CUDA
    tensor_parallel_size: int = 1  # ranks (processes) the model is sharded over (engine/parallel/)
    # MoE experts spread whole over those ranks, tokens sent to them by all-to-all (engine/parallel/
    # expert_parallel.py; vLLM's --enable-expert-parallel); off: every rank holds a slice of every expert
    enable_expert_parallel: bool = False
    kv_offload_bytes: int = 0  # host-memory KV tier under the device pool (engine/kv_offload/); 0: none
    kv_offload_dir: str | None = None  # disk KV tier: a directory for block files; None: none
    kv_offload_dir_bytes: int = 0  # ... and its size
    cpu_affinity: tuple[int, ...] = ()  # CPUs the engine process pins itself to (`serve`'s plan, core/cpus.py); (): none
    enable_lora: bool = False  # requests may run under LoRA adapters (engine/lora/)
    max_loras: int = 1  # adapters resident at once (slots); a step mixes at most this many
    max_lora_rank: int = 16  # the largest adapter rank a slot holds
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT directory, loaded at start
    # --speculative-config (vLLM's JSON object, a dict or a SpeculativeConfig; core/speculative.py); None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # outputs carry this step's part only (new tokens, logprobs, text), not the whole request's
    # so far: a serving worker streams deltas, and copying a long prompt per token per sequence
    # was O(context) of host time in every decode step (issue 37)
    delta_outputs: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        gguf = find_gguf(self.model)  # LLM("model.gguf") as vLLM takes it: served from its derived directory
        if gguf is not None:
            self.model = str(prepare_gguf(gguf))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)  # one clear error for a bad value
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.decoding_step_tokens is not None and self.decoding_step_tokens < self.block_size:
            raise ValueError("decoding_step_tokens must be at least block_size")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.enable_expert_parallel:
            problem = expert_parallel_problem(served_config(self.model), self.tensor_parallel_size)
            if problem:
                raise ValueError(f"enable_expert_parallel: {problem}")
        check_offload(self)
        self.speculative_config = parse_speculative_config(self.speculative_config, self.model)
        problem = refusal(self.features)  # which features combine: core/compatibility.py
        if problem:
            raise ValueError(problem)
        self._hybrid_limits()
        if self.async_scheduling and self.cuda_graphs is False:
            raise ValueError("async_scheduling runs the padded (graph) decode step: it cannot run with "
                             "cuda_graphs=False (--no-cuda-graphs)")
        if self.cuda_graphs and torch.device(self.device).type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={self.device!r}")

    def _hybrid_limits(self) -> None:
        """A hybrid model (recurrent state: core/hybrid.py) refuses what it cannot run yet, and runs
        without prefix caching: its state is not saved at block boundaries, so a cached KV prefix
        would come without the state it needs (said once in the log, as vLLM did for hybrids)."""
        cfg = served_config(self.model)
        problem = hybrid_problem(cfg, self.features)
        if problem:
            raise ValueError(problem)
        if cfg is not None and cfg.is_hybrid and self.enable_prefix_caching:
            logging.getLogger(__name__).info("%s keeps recurrent state: prefix caching is off for it (no state "
                                             "checkpoints at block boundaries yet)", cfg.architecture)
            self.enable_prefix_caching = False

    @property
    def features(self) -> set[str]:
        """The core/compatibility.py features this configuration turns on (Mooncake is a
        worker's --kv-backend, not the engine's: engine/args.py adds it)."""
        method = self.speculative_config.method if isinstance(self.speculative_config, SpeculativeConfig) else None
        on = {"tensor-parallel": self.tensor_parallel_size > 1, "expert-parallel": self.enable_expert_parallel,
              "lora": self.enable_lora,
              "cuda-graphs": self.cuda_graphs is True, "async-scheduling": self.async_scheduling,
              "ngram": method == "ngram", "draft-model": method == "draft_model", "mtp": method == "mtp",
              "kv-offload-host": self.kv_offload_bytes > 0, "kv-offload-disk": self.kv_offload_dir is not None,
              "fp8-kv-cache": self.kv_cache_dtype.startswith("fp8"),
              "quantized": checkpoint_is_quantized(self.model, self.quantization)}
        return {feature for feature, yes in on.items() if yes}

    @property
    def use_cuda_graphs(self) -> bool:
        # not by default under TP or LoRA yet: their graphs are checked on the CPU path only (the padded
        # step eagerly) until bench/gpu/graphs_tp_lora.py has run on a GPU; cuda_graphs=True turns them on
        if self.cuda_graphs is None:  # (mtp: its drafter reads every step's hidden states, which graphs do not keep)
            mtp = isinstance(self.speculative_config, SpeculativeConfig) and self.speculative_config.method == "mtp"
            return torch.device(self.device).type == "cuda" and self.tensor_parallel_size == 1 \
                and not self.enable_lora and not mtp
        return self.cuda_graphs

    @property
    def fp8_activations_min_rows(self) -> int | None:
        """The fewest rows of x a W8A8 matmul takes (1: every matmul), None: none does."""
        if self.fp8_activations is None:
            from splitserve.kernels.fp8_scaled_mm import device_has_fp8_matmul

            if not device_has_fp8_matmul(self.device):
                return None
            from splitserve.kernels.triton_gemv import GEMV_MAX_ROWS

            # decode-sized matmuls are memory-bound: the weight-only kernel reads the same bytes without the
            # activation quantization's extra launches (not fused yet)
            return GEMV_MAX_ROWS + 1
        return 1 if self.fp8_activations else None

    @property
    def use_warm_up(self) -> bool:
        return torch.device(self.device).type == "cuda" if self.warm_up is None else self.warm_up

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)


def check_offload(cfg: EngineConfig) -> None:
    """One clear error for offload tiers that cannot work as configured."""
    if cfg.kv_offload_bytes < 0 or cfg.kv_offload_dir_bytes < 0:
        raise ValueError("--kv-offload-gib and --kv-offload-dir-gib must be >= 0")
    if (cfg.kv_offload_dir is None) != (cfg.kv_offload_dir_bytes == 0):
        raise ValueError("--kv-offload-dir and --kv-offload-dir-gib go together: the disk tier needs both")
    if (cfg.kv_offload_bytes or cfg.kv_offload_dir) and not cfg.enable_prefix_caching:
        raise ValueError("KV offload tiers hold prefix-cache blocks: they need prefix caching on")


def checkpoint_is_quantized(model: str | None, quantization: str | None) -> bool:
    """--quantization given, or the checkpoint's config.json has a quantization_config (a
    checkpoint that cannot be read is the loader's to refuse)."""
    if quantization is not None:
        return True
    cfg = served_config(model)
    return cfg is not None and cfg.raw.get("quantization_config") is not None
