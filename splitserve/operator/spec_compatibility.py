"""The compatibility table (core/compatibility.py) on an InferenceDeployment: which features
each engine role's workers get from the spec, the problems parse_spec reports for the refused
pairs, and the CRD's CEL rules for them, generated here so they cannot drift from the table.

Per role, as render_common.engine_args passes the flags: tensorParallelSize and kvOffload are
the role's own; loras, kvTransfer.backend and engine.kvCacheDtype reach both roles;
engine.speculative and engine.asyncScheduling only the decode workers; engine.expertParallel
the roles whose tensorParallelSize is above 1. CUDA graphs cannot be
forced on from a spec, and a quantized checkpoint is only known inside the pods (no pair with
it is refused today): neither has a field here.

`python -m splitserve.operator.spec_compatibility` prints the rules' YAML;
`--write` replaces the generated block in the chart's CRD (between its BEGIN/END markers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from splitserve.core.compatibility import all_pairs, message, refusals, verdict

ROLES = ("prefill", "decode")
CRD = Path(__file__).resolve().parents[2] / "charts/splitserve/crds/inferencedeployments.splitserve.io.yaml"
BEGIN = "# BEGIN generated compatibility rules (python -m splitserve.operator.spec_compatibility --write)"
END = "# END generated compatibility rules"
INDENT = " " * 16  # spec's x-kubernetes-validations items in the CRD


def role_features(role: str, tensor_parallel_size: int, host_gib: float, disk_gib: float, loras: bool,
                  speculative_method: str | None, async_scheduling: bool, kv_backend: str,
                  kv_cache_dtype: str, expert_parallel: bool = False) -> set[str]:
    """The features one role's workers run with (role: prefill or decode)."""
    decode = role == "decode"
    on = {"tensor-parallel": tensor_parallel_size > 1, "expert-parallel": expert_parallel and tensor_parallel_size > 1,
          "lora": loras,
          "async-scheduling": decode and async_scheduling,
          "ngram": decode and speculative_method == "ngram", "draft-model": decode and speculative_method == "draft_model",
          "mtp": decode and speculative_method == "mtp",
          "kv-offload-host": host_gib > 0, "kv-offload-disk": disk_gib > 0, "mooncake": kv_backend == "mooncake",
          "fp8-kv-cache": kv_cache_dtype != "auto"}
    return {feature for feature, yes in on.items() if yes}


def compatibility_problems(roles: dict, loras: bool, speculative: str, async_scheduling: bool, kv_backend: str,
                           kv_cache_dtype: str, expert_parallel: bool = False) -> list[str]:
    """The table's line for every refused pair some role would run with (once each); `roles`
    maps prefill / decode to its RoleSpec, `speculative` is the decode workers' JSON ("": off)."""
    method = json.loads(speculative).get("method") if speculative else None
    found: list[str] = []
    for name in ROLES:
        role = roles[name]
        features = role_features(name, role.tensor_parallel_size, role.kv_offload.host_gib, role.kv_offload.disk_gib,
                                 loras, method, async_scheduling, kv_backend, kv_cache_dtype, expert_parallel)
        found += [line for line in refusals(features) if line not in found]
    return found


def _condition(feature: str, role: str) -> str | None:
    """CEL over spec (`self`), true when `role`'s workers run with `feature`; None: no field says it."""
    r = f"self.{role}"
    engine = "has(self.engine) && has(self.engine.{0})"
    tensor_parallel = f"has({r}) && has({r}.tensorParallelSize) && {r}.tensorParallelSize > 1"
    return {
        "tensor-parallel": tensor_parallel,
        "expert-parallel": engine.format("expertParallel") + f" && self.engine.expertParallel && {tensor_parallel}",
        "lora": "has(self.loras) && size(self.loras) > 0",
        "async-scheduling": (engine.format("asyncScheduling") + " && self.engine.asyncScheduling")
        if role == "decode" else None,
        "ngram": (engine.format("speculative") + " && self.engine.speculative.method == 'ngram'")
        if role == "decode" else None,
        "draft-model": (engine.format("speculative") + " && self.engine.speculative.method == 'draft_model'")
        if role == "decode" else None,
        "mtp": (engine.format("speculative") + " && self.engine.speculative.method == 'mtp'")
        if role == "decode" else None,
        "kv-offload-host": f"has({r}) && has({r}.kvOffload) && has({r}.kvOffload.hostGiB) && {r}.kvOffload.hostGiB > 0",
        "kv-offload-disk": f"has({r}) && has({r}.kvOffload) && has({r}.kvOffload.disk)",
        "mooncake": "has(self.kvTransfer) && has(self.kvTransfer.backend) && self.kvTransfer.backend == 'mooncake'",
        "fp8-kv-cache": engine.format("kvCacheDtype") + " && self.engine.kvCacheDtype != 'auto'",
    }.get(feature)


# one field picks one of them: no spec can ask for both, so no rule is needed
ONE_FIELD = {("ngram", "draft-model"), ("ngram", "mtp"), ("draft-model", "mtp")}


def crd_rules() -> list[dict]:
    """A CEL rule (spec level) per refused pair a spec can ask for, with the table's line."""
    rules = []
    for a, b in all_pairs():
        if verdict(a, b).works or (a, b) in ONE_FIELD:
            continue
        parts = [f"!(({_condition(a, role)}) && ({_condition(b, role)}))" for role in ROLES
                 if _condition(a, role) and _condition(b, role)]
        if parts:
            rules.append({"rule": " && ".join(parts), "message": message(a, b)})
    return rules


def crd_rules_yaml() -> str:
    """The generated block as it stands in the CRD, markers included."""
    lines = [INDENT + BEGIN]
    for r in crd_rules():
        lines += [f"{INDENT}- rule: {json.dumps(r['rule'])}", f"{INDENT}  message: {json.dumps(r['message'])}"]
    return "\n".join(lines + [INDENT + END]) + "\n"


def crd_block(text: str) -> str:
    """The generated block of the CRD's text (markers included); ValueError without markers."""
    start, end = text.find(INDENT + BEGIN), text.find(INDENT + END)
    if start < 0 or end < 0:
        raise ValueError(f"{CRD}: no generated compatibility block ({BEGIN!r} ... {END!r})")
    return text[start:end + len(INDENT + END) + 1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m splitserve.operator.spec_compatibility",
                                 description="the CRD's CEL rules for the refused feature pairs")
    ap.add_argument("--write", action="store_true", help=f"replace the generated block in {CRD.name}")
    args = ap.parse_args(argv)
    if not args.write:
        print(crd_rules_yaml(), end="")
        return
    text = CRD.read_text()
    CRD.write_text(text.replace(crd_block(text), crd_rules_yaml()))


if __name__ == "__main__":
    main()

