"""How the suite is cut into units that run in parallel, and in what order (docs/testing.md).

`make test` runs pytest with two xdist workers (`-n 2 --dist loadscope`, with the scheduler
of tests/conftest.py, which asks `unit_of` for a test's scope). A unit is what one worker
runs from start to end: a module (its module-scoped fixtures are set up once), or a whole
directory where a session-scoped fixture is shared by its modules (the reliability
cluster, the chaos `serve`), or the modules that share one `serve` layout
(tests/helpers/shared_serve.py), so no shared fixture is ever started twice. Units go out
longest first (longest-processing-time order, from the committed module times in
`module_seconds.json`), so the last unit to start is a short one; the image build, which
waits on the network and runs in the background from the start of the session
(tests/suite/image_build.py), goes last.

Pure functions; the pytest hooks that apply them live in tests/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.shared_serve import USERS as SHARED_SERVE_USERS

HERE = Path(__file__).parent
MODULE_SECONDS = HERE / "module_seconds.json"

# Directories whose modules share one session-scoped fixture: one unit each.
SHARED_DIRS = {
    "tests/reliability": "the reliability cluster (redis, 2 decode + 1 prefill, router; mutual TLS)",
    "tests/chaos": "one `splitserve serve` (2 decode + 1 prefill) the attacks share",
}
# Units run last whatever they cost: they wait on something started in the background.
LAST = ("tests/image/test_image.py",)
DEFAULT_SECONDS = 2.0  # a module with no recorded time yet

# Modules marked `slow`: they start a real serving stack (`splitserve serve`, a worker set, a
# router, the image) or fuzz one for tens of seconds. `make test` runs them, `make test-fast`
# (`-m "not slow"`) leaves them out for the edit loop.
SLOW = {
    "tests/benchmark/test_compare.py",
    "tests/benchmark/test_serve_overhead.py",
    "tests/benchmark/test_gpt_oss_20b_script.py",  # bench/gpu/gpt_oss_20b.py --dry-run starts `serve`
    "tests/chaos",
    "tests/e2e",
    "tests/image",
    "tests/reliability",
    "tests/security/test_fuzz_http.py",
    "tests/security/test_fuzz_grpc.py",
    "tests/security/test_http_limits.py",
    "tests/security/test_disk_tier_serve.py",  # a `serve` with a disk tier, attacked
    "tests/workers/test_cpu_pinning.py",
    "tests/kernels/test_engine_triton_interpreter.py",
    "tests/kernels/test_compile_for_cuda.py",
    "tests/engine/test_gguf_model.py",  # transformers loads both real GGUF models (Gemma 3: 262k-token vocabulary)
    "tests/operator/test_cluster_token.py",  # a router and two decode worker processes
    "tests/operator/test_scale_to_zero.py",  # routers and a decode worker process, with the operator
    "tests/operator/test_cert_manager_tls.py",  # a router and a decode worker over mutual TLS
    # engines over tensor-parallel rank processes, and the walk of every feature pair (issue 50:
    # these took test-fast from 127 s to over 11 minutes here; `make test` runs them)
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_glm4_moe_tensor_parallel.py",
    "tests/engine/test_expert_parallel_tensor_parallel.py",
    "tests/engine/test_expert_parallel_features.py",
    "tests/engine/test_deepseek_v3_tensor_parallel.py",
    "tests/engine/test_spec_decode_mtp_tensor_parallel.py",
    "tests/engine/test_minimax_m2_tensor_parallel.py",
    "tests/engine/test_gpt_oss_tensor_parallel.py",
    "tests/engine/test_gpt_oss_mxfp4_tensor_parallel.py",
    "tests/engine/test_tensor_parallel_kv.py",
    "tests/engine/test_lora_tensor_parallel.py",
    "tests/engine/test_kv_offload_tensor_parallel.py",
    "tests/engine/test_compatibility_pairs.py",
    "tests/engine/test_async_scheduling.py",
    "tests/engine/test_async_scheduling_features.py",
    "tests/workers/test_tensor_parallel_engine_process.py",
    "tests/workers/test_tensor_parallel_mooncake.py",  # TP 2 prefill and decode workers over Mooncake
}


def torch_threads_per_worker(cpus: int, workers: int) -> int:
    """torch's intra-op threads for one xdist worker: its share of the CPUs. torch starts one
    OpenMP thread per CPU in every process, so two workers on two cores ran four spinning
    threads on two cores: an engine module took 2x the wall and 2.5x the CPU time of one
    thread each (tests/engine/test_model_families.py: 48-61 s against 25-27 s here). Engine
    processes a test starts inherit it (EngineProcess passes its parent's thread count)."""
    return max(1, cpus // max(1, workers))


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The parallel unit of a test: the serve layout its module shares with others
    (tests/helpers/shared_serve.py), its shared directory, else its module."""
    module = module_of(nodeid)
    if module in SHARED_SERVE_USERS:
        return "shared serve " + SHARED_SERVE_USERS[module]
    for directory in SHARED_DIRS:
        if module.startswith(directory + "/"):
            return directory
    return module


def is_slow(nodeid: str) -> bool:
    module = module_of(nodeid)
    return any(module == p or module.startswith(p + "/") for p in SLOW)


def load_module_seconds(path: Path = MODULE_SECONDS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def unit_seconds(nodeids: list[str], module_seconds: dict[str, float]) -> dict[str, float]:
    """Expected seconds of each unit: the sum of its modules' recorded times."""
    modules: dict[str, str] = {}
    for nodeid in nodeids:
        modules.setdefault(module_of(nodeid), unit_of(nodeid))
    cost: dict[str, float] = {}
    for module, unit in modules.items():
        cost[unit] = cost.get(unit, 0.0) + module_seconds.get(module, DEFAULT_SECONDS)
    return cost


def order(nodeids: list[str], module_seconds: dict[str, float]) -> list[str]:
    """Node ids regrouped by unit, units longest first and LAST at the end; within a unit
    the collection order is kept (tests that rely on file order still get it)."""
    cost = unit_seconds(nodeids, module_seconds)
    rank = {unit: i for i, unit in enumerate(sorted(cost, key=lambda u: (u in LAST, -cost[u], u)))}
    position = {nodeid: i for i, nodeid in enumerate(nodeids)}
    return sorted(nodeids, key=lambda n: (rank[unit_of(n)], position[n]))
