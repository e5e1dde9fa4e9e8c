"""Which quantization a checkpoint uses, read from config.json's `quantization_config`
without torch (serve checks it before anything starts; the engine's weight reader,
engine/quant/, converts the tensors it describes).

Supported (weight-only on every device: activations stay in the model dtype):
  fp8                 block-wise FP8 (`weight_block_size`, float8_e4m3fn `weight` and
                      `weight_scale_inv`, as Qwen3-FP8 and DeepSeek ship), or per-tensor
                      `weight_scale` (AutoFP8 / vLLM-serialized, e.g. Llama-3 FP8 releases)
  gptq                4-bit, any group size or -1, sym or asym, with or without act-order
  awq                 4-bit GEMM packing with zero points
  compressed-tensors  float-quantized (FP8, per-tensor / per-channel / block scales),
                      pack-quantized (INT4/INT8, channel or group), naive- and
                      int-quantized (INT8), nvfp4- and mxfp4-pack-quantized (FP4)
  mxfp4               gpt-oss's experts as shipped: `<proj>_blocks` (E2M1 pairs) and
                      `<proj>_scales` (E8M0 per 32 values); `modules_to_not_convert` must
                      hold no quantized tensor

Anything else (bitsandbytes, marlin, hqq, exl2, ...) or a setting outside these is refused
with one line naming it and what is supported, instead of being served as float.

Not split yet (344 lines): each format's reader of `quantization_config` is short and they
share the refusal wording; the tensor-parallel split check (`tensor_parallel_split_problem`)
is the piece that stands alone and should move to a module of its own next.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from splitserve.core.model_config import CheckpointError

METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "mxfp4")
QUANTIZATION_CHOICES = METHODS + ("gguf",)  # --quantization; gguf: a .gguf model (core/gguf_model.py)
CT_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized", "int-quantized", "nvfp4-pack-quantized",
              "mxfp4-pack-quantized")
FP4_GROUPS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}  # FP4 values per scale
SUPPORTED_LINE = ("supported: fp8 (block-wise or per-tensor), gptq and awq (4-bit), compressed-tensors "
                  f"({', '.join(CT_FORMATS)}), mxfp4 (gpt-oss)")


@dataclass(frozen=True)
class QuantSpec:
    method: str  # one of METHODS
    format: str  # fp8-block | gptq | awq | float-quantized | pack-quantized | naive-quantized (int8) | mxfp4
    #              | nvfp4-pack-quantized | mxfp4-pack-quantized
    bits: int = 4
    group_size: int = -1  # -1: one group per output row (channel / whole input)
    symmetric: bool = True
    desc_act: bool = False  # GPTQ act-order: g_idx permutes the input columns
    zero_plus_one: bool = True  # GPTQ v1 stores zero points minus one (vLLM and transformers add it back)
    block: tuple[int, int] | None = None  # FP8 block-wise: (rows, cols) per scale
    activations: str | None = None  # what the checkpoint asks of activations (we run weight-only)
    not_converted: tuple[str, ...] = ()  # mxfp4: modules_to_not_convert (patterns, '*' a wildcard)
    # Which linears are quantized (modules_to_not_convert, compressed-tensors' ignore) is
    # read from the tensors themselves (engine/quant/reader.py): the rest load as float.

    def describe(self) -> str:
        if self.method in ("gptq", "awq"):
            return (f"{self.method} {self.bits}-bit, group {self.group_size}, "
                    f"{'sym' if self.symmetric else 'asym'}{', act-order' if self.desc_act else ''}")
        if self.format == "fp8-block":
            return f"fp8 block-wise {self.block[0]}x{self.block[1]}"
        if self.method == "fp8":
            return "fp8 per-tensor scales"
        if self.format == "float-quantized":
            return f"compressed-tensors float-quantized (fp8{', blocks' if self.block else ''})"
        if self.format == "mxfp4":
            return "mxfp4 (E2M1 values, an E8M0 scale per 32)"
        if self.format in FP4_GROUPS:
            return f"compressed-tensors {self.format} (fp4, group {self.group_size})"
        return f"compressed-tensors {self.format} int{self.bits}, group {self.group_size}"


def _refuse(source: str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: {what} is not supported ({SUPPORTED_LINE})")


def quantization_from_config(raw: dict, source: str = "config.json", override: str | None = None) -> QuantSpec | None:
    """The checkpoint's QuantSpec, None for a float checkpoint; CheckpointError (one line)
    for a method or setting this build cannot serve, or an `override` (--quantization)
    the checkpoint does not match."""
    qc = raw.get("quantization_config")
    if qc is None:
        if override:
            raise CheckpointError(f"{source}: --quantization {override} given, but the checkpoint has no "
                                  "quantization_config (it is a float checkpoint; drop the flag)")
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    method = "compressed-tensors" if method == "compressed-tensors" else method
    if method not in METHODS:
        raise _refuse(source, f"quantization method {qc.get('quant_method')!r}")
    if override and override != method:
        raise CheckpointError(f"{source}: --quantization {override} given, but the checkpoint is quantized "
                              f"with {method} (drop the flag or pass --quantization {method})")
    if method == "fp8":
        return _fp8(qc, source)
    if method in ("gptq", "awq"):
        return _int4(qc, method, source)
    if method == "mxfp4":
        skip = qc.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise _refuse(source, f"mxfp4 with modules_to_not_convert {skip!r} (need a list of module names)")
        return QuantSpec("mxfp4", "mxfp4", bits=4, group_size=32, not_converted=tuple(skip))
    return _compressed_tensors(qc, source)


def _fp8(qc: dict, source: str) -> QuantSpec:
    """Block-wise with `weight_block_size` (weight_scale_inv); without it, AutoFP8's layout as
    vLLM serializes it: one `weight_scale` per tensor (or per row)."""
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(source, f"fp8 with weight_block_size {block!r} (need [rows, cols], e.g. [128, 128])")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(source, f"fp8 fmt {fmt!r} (only e4m3 weights)")
    scheme = qc.get("activation_scheme", "dynamic")
    activations = f"fp8 {scheme}" if scheme else None
    if block is None:
        return QuantSpec("fp8", "float-quantized", bits=8, activations=activations)
    return QuantSpec("fp8", "fp8-block", bits=8, block=(block[0], block[1]), activations=activations)


def _int4(qc: dict, method: str, source: str) -> QuantSpec:
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise _refuse(source, f"{method} with bits {bits!r} (only 4-bit)")
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise _refuse(source, f"{method} group_size {group!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(source, f"awq version {version!r} (only the GEMM packing)")
        if not qc.get("zero_point", True):
            raise _refuse(source, "awq with zero_point false")
        return QuantSpec("awq", "awq", bits=4, group_size=group, symmetric=False)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(source, f"gptq checkpoint_format {fmt!r}")
    return QuantSpec("gptq", "gptq", bits=4, group_size=group, symmetric=bool(qc.get("sym", True)),
                     desc_act=bool(qc.get("desc_act", False)), zero_plus_one=fmt == "gptq")


def _compressed_tensors(qc: dict, source: str) -> QuantSpec:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(source, f"compressed-tensors with {len(groups) if isinstance(groups, dict) else 0} "
                              "config_groups (exactly one scheme for all linears)")
    scheme = next(iter(groups.values()))
    fmt = scheme.get("format") or qc.get("format")
    if fmt not in CT_FORMATS:
        raise _refuse(source, f"compressed-tensors format {fmt!r}")
    w = scheme.get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if scheme.get("targets") not in (["Linear"], None):
        raise _refuse(source, f"compressed-tensors targets {scheme.get('targets')!r} (only ['Linear'])")
    if w.get("dynamic"):
        raise _refuse(source, "compressed-tensors with dynamic weight quantization")
    # actorder weight/static changes only the calibration; group (older releases) stores weight_g_idx
    actorder = w.get("actorder") or None
    if actorder not in (None, "weight", "static", "group") or (actorder == "group" and fmt != "pack-quantized"):
        raise _refuse(source, f"compressed-tensors {fmt} with actorder {actorder!r}")
    act = scheme.get("input_activations")
    activations = f"{act.get('type')}{act.get('num_bits')} {act.get('strategy')}" if act else None
    if fmt in FP4_GROUPS:
        group = FP4_GROUPS[fmt]
        if kind != "float" or bits != 4 or w.get("group_size") != group or not w.get("symmetric", True):
            raise _refuse(source, f"compressed-tensors {fmt} {kind}{bits} group {w.get('group_size')!r}"
                                  f"{'' if w.get('symmetric', True) else ' asym'} (fp4, symmetric, group {group})")
        return QuantSpec("compressed-tensors", fmt, bits=4, group_size=group, activations=activations)
    if fmt == "float-quantized":
        if kind != "float" or bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise _refuse(source, f"compressed-tensors float-quantized {kind}{bits} {strategy}")
        block = tuple(w.get("block_structure") or ()) or None
        return QuantSpec("compressed-tensors", fmt, bits=8, block=block, activations=activations)
    fmt = "naive-quantized" if fmt == "int-quantized" else fmt  # int-quantized: the same int8 tensors (W8A8)
    want_bits = (4, 8) if fmt == "pack-quantized" else (8,)
    if kind != "int" or bits not in want_bits or strategy not in ("channel", "group"):
        raise _refuse(source, f"compressed-tensors {fmt} {kind}{bits} {strategy} (int{'/'.join(map(str, want_bits))}"
                              ", channel or group)")
    group = int(w.get("group_size") or -1) if strategy == "group" else -1
    return QuantSpec("compressed-tensors", fmt, bits=bits, group_size=group, symmetric=bool(w.get("symmetric", True)),
                     desc_act=actorder == "group", activations=activations)


# ---- what the tensors say, checked against the config (header names and dtypes only) ----------

# per format: (the suffix that marks a quantized linear, the suffixes it may have, those it must
# have, and the safetensors dtype its marked tensor's codes come in)
PARTS = {
    "fp8-block": ("weight_scale_inv", ("weight", "weight_scale_inv", "input_scale"), ("weight", "weight_scale_inv")),
    "float-quantized": ("weight_scale", ("weight", "weight_scale", "input_scale"), ("weight", "weight_scale")),
    "naive-quantized": ("weight_scale", ("weight", "weight_scale", "weight_zero_point", "input_scale"),
                        ("weight", "weight_scale")),
    "gptq": ("qweight", ("qweight", "qzeros", "scales", "g_idx"), ("qweight", "qzeros", "scales")),
    "awq": ("qweight", ("qweight", "qzeros", "scales"), ("qweight", "qzeros", "scales")),
    "pack-quantized": ("weight_packed", ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                                         "weight_g_idx"), ("weight_packed", "weight_scale", "weight_shape")),
    "nvfp4-pack-quantized": ("weight_packed", ("weight_packed", "weight_scale", "weight_global_scale",
                                               "input_global_scale"),
                             ("weight_packed", "weight_scale", "weight_global_scale")),
    "mxfp4-pack-quantized": ("weight_packed", ("weight_packed", "weight_scale"), ("weight_packed", "weight_scale")),
    # gpt-oss: `<stack>_blocks` and `<stack>_scales` (an underscore, not a dot: SEPARATOR)
    "mxfp4": ("blocks", ("blocks", "scales"), ("blocks", "scales")),
}
CODES = {"fp8-block": ("weight", "F8_E4M3"), "float-quantized": ("weight", "F8_E4M3"),
         "naive-quantized": ("weight", "I8"), "gptq": ("qweight", "I32"), "awq": ("qweight", "I32"),
         "pack-quantized": ("weight_packed", "I32"), "nvfp4-pack-quantized": ("weight_packed", "U8"),
         "mxfp4-pack-quantized": ("weight_packed", "U8"), "mxfp4": ("blocks", "U8")}
SEPARATOR = {"mxfp4": "_"}  # between a quantized tensor's module and its suffix; "." otherwise


def split_name(spec: QuantSpec, name: str) -> tuple[str, str]:
    """A checkpoint tensor's (module, suffix) in `spec`'s naming."""
    module, _, suffix = name.rpartition(SEPARATOR.get(spec.format, "."))
    return module, suffix


def not_converted(spec: QuantSpec, module: str) -> bool:
    """Whether `module` (a checkpoint name) is under one of mxfp4's modules_to_not_convert."""
    return any(fnmatchcase(module, p) or fnmatchcase(module, f"{p}.*") for p in spec.not_converted)


def quantized_linears(spec: QuantSpec, headers: dict[str, dict], source: str) -> dict[str, set[str]]:
    """module -> the suffixes of its tensors, for each quantized linear of a checkpoint whose
    tensor headers are `headers`; CheckpointError (one line) for a linear missing a tensor,
    or codes of another dtype than the format's."""
    marker, allowed, required = PARTS[spec.format]
    sep = SEPARATOR.get(spec.format, ".")
    modules = {split_name(spec, n)[0] for n in headers if n.endswith(sep + marker)}
    plan = {m: {s for s in allowed if f"{m}{sep}{s}" in headers} for m in sorted(modules)}
    codes, dtype = CODES[spec.format]
    for module, have in plan.items():
        missing = set(required) - have
        if missing:
            raise CheckpointError(f"{source}: quantized linear {module!r} lacks {sorted(missing)} ({spec.describe()})")
        got = headers[f"{module}{sep}{codes}"].get("dtype")
        if got != dtype:
            raise CheckpointError(f"{source}: {module}{sep}{codes} is {got}; {spec.describe()} stores {dtype} there"
                                  f"{' (e5m2 FP8 weights are not supported)' if got == 'F8_E5M2' else ''}")
        if not_converted(spec, module):
            raise CheckpointError(f"{source}: {module}{sep}{marker} is quantized, but quantization_config's "
                                  "modules_to_not_convert lists it")
    return plan


QUANT_SUFFIXES = tuple(sorted({f"{SEPARATOR.get(f, '.')}{s}" for f, (_, allowed, _) in PARTS.items()
                               for s in allowed} - {".weight"}))


def tensors_problem(spec: QuantSpec | None, headers: dict[str, dict], source: str) -> str | None:
    """One line when the tensors and the config disagree: quantized tensors in a float
    checkpoint, a quantization_config whose tensors are not there, a quantized linear
    missing a tensor or with codes of another dtype."""
    quantized = [n for n, info in headers.items() if info.get("dtype") in ("F8_E4M3", "F8_E5M2")
                 or (n.endswith(QUANT_SUFFIXES) and not n.endswith(("_blocks", "_scales")))
                 or (n.endswith(("_blocks", "_scales")) and info.get("dtype") == "U8")]
    if spec is None:
        if quantized:
            return (f"{source}: holds quantized tensors (e.g. {sorted(quantized)[0]!r}) but config.json has no "
                    "quantization_config: an incomplete checkpoint (copy config.json from the quantized release)")
        return None
    marker = SEPARATOR.get(spec.format, ".") + PARTS[spec.format][0]
    if not any(n.endswith(marker) for n in headers):
        return (f"{source}: config.json says {spec.describe()}, but no tensor ends in '{marker}': the weights "
                "are not in that format (a float checkpoint with a stray quantization_config?)")
    try:
        plan = quantized_linears(spec, headers, source)
    except CheckpointError as exc:
        return str(exc)
    for module in plan:
        problem = shapes_problem(spec, module, headers, source)
        if problem:
            return problem
    for name in sorted(quantized):
        module = split_name(spec, name)[0]
        if module not in plan:
            return (f"{source}: {name} ({headers[name].get('dtype')}) belongs to no quantized linear: there is no "
                    f"{module}{marker} ({spec.describe()})")
    return None


def _shape(headers: dict[str, dict], name: str) -> tuple[int, ...] | None:
    shape = headers.get(name, {}).get("shape")
    return tuple(shape) if isinstance(shape, list) and all(isinstance(v, int) for v in shape) else None


def shapes_problem(spec: QuantSpec, module: str, headers: dict[str, dict], source: str) -> str | None:
    """One line when a quantized linear's tensor shapes (from the safetensors headers) do not fit
    the config's group size or block, as engine/quant/{gptq,awq,fp8}.py would find loading them
    (a GPTQ group_size of 7 over 256 input columns). Formats whose input width is not in the
    headers (pack-quantized keeps it in a tensor's values) are left to the loader."""
    if spec.format in ("gptq", "awq"):
        qweight, scales, qzeros = (_shape(headers, f"{module}.{s}") for s in ("qweight", "scales", "qzeros"))
        if qweight is None or len(qweight) != 2:
            return f"{source}: {module}.qweight has shape {qweight}; {spec.describe()} stores a 2-D one"
        # GPTQ packs eight 4-bit codes per int32 down the input dimension, AWQ across the outputs
        k, n = (qweight[0] * 8, qweight[1]) if spec.format == "gptq" else (qweight[0], qweight[1] * 8)
        group = k if spec.group_size == -1 else spec.group_size
        if k % group:
            return (f"{source}: {module} has {k} input columns, which group_size {group} does not divide "
                    f"({spec.describe()}): the config's group size is not the weights'")
        want_scales, want_zeros = (k // group, n), (k // group, n // 8)
        if scales != want_scales or qzeros != want_zeros:
            return (f"{source}: {module} has scales {list(scales or ())} and qzeros {list(qzeros or ())}; {k} inputs, "
                    f"{n} outputs and group_size {group} need {list(want_scales)} and {list(want_zeros)} "
                    f"({spec.describe()})")
    elif spec.format == "fp8-block":
        weight, scale = _shape(headers, f"{module}.weight"), _shape(headers, f"{module}.weight_scale_inv")
        if weight is None or len(weight) != 2:
            return f"{source}: {module}.weight has shape {weight}; {spec.describe()} stores a 2-D one"
        want = (-(-weight[0] // spec.block[0]), -(-weight[1] // spec.block[1]))
        if scale != want:
            return (f"{source}: {module}.weight_scale_inv has shape {list(scale or ())}; blocks of "
                    f"{spec.block[0]}x{spec.block[1]} over a {weight[0]}x{weight[1]} weight need {list(want)}")
    elif spec.format == "mxfp4":
        blocks, scales = _shape(headers, f"{module}_blocks"), _shape(headers, f"{module}_scales")
        if blocks is None or len(blocks) < 3 or blocks[-1] != 16 or scales != blocks[:-1]:
            return (f"{source}: {module}_blocks has shape {list(blocks or ())} and {module}_scales "
                    f"{list(scales or ())}; mxfp4 stores [..., N, K / 32, 16] and [..., N, K / 32]")
    return None


def tensor_parallel_split_problem(spec: QuantSpec | None, cfg, size: int, expert_parallel: bool = False) -> str | None:
    """Why a GPTQ / AWQ / FP4 model's row-parallel linears (o_proj, down_proj, each expert's
    down_proj) cannot be split over `size` ranks, or None: each rank takes a 1/size slice
    of their input columns, and a slice
    must hold whole quantization groups (engine/parallel/sharding.py narrow; group_size -1 is
    one group over all of them). gpt-oss's mxfp4 quantizes only the experts, which expert
    parallelism keeps whole."""
    fp4 = spec is not None and (spec.format == "mxfp4" or spec.format in FP4_GROUPS)
    if spec is None or size <= 1 or not (spec.method in ("gptq", "awq") or fp4):
        return None
    row_parallel = [] if spec.format == "mxfp4" else [("self_attn.o_proj", cfg.num_heads * cfg.head_dim)]
    if cfg.num_layers > len(cfg.moe_layers) and spec.format != "mxfp4":  # some layer has a dense MLP
        row_parallel.append(("mlp.down_proj", cfg.intermediate_size))
    if cfg.num_experts and not (fp4 and expert_parallel):
        row_parallel.append(("mlp.experts.N.down_proj", cfg.moe_intermediate_size))
    for module, columns in row_parallel:
        group = columns if spec.group_size == -1 else spec.group_size
        if (columns // size) % group:
            return (f"its {module} has {columns} input columns, {columns // size} per rank, which is not whole "
                    f"quantization groups of {group} ({spec.describe()})")
    return None
