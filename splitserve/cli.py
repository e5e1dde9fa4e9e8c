"""The `splitserve` command. Each subcommand lives in the component that owns it;
this module only dispatches, importing lazily so `splitserve --help` stays fast."""

from __future__ import annotations

import importlib
import sys

from splitserve import __version__

# subcommand -> (module, help). Each module exposes `main(argv: list[str]) -> int | None`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("splitserve.serve", "run router, prefill and decode workers on this machine"),
    "router": ("splitserve.router.main", "run one router replica (cluster mode)"),
    "prefill-pool": ("splitserve.prefill_worker.pool", "Ray driver keeping prefill actors alive (cluster mode)"),
    "decode-worker": ("splitserve.decode_worker.main", "run one decode worker (cluster mode)"),
    "prefill-worker": ("splitserve.prefill_worker.main", "run one prefill worker without Ray"),
    "drain": ("splitserve.decode_worker.admin", "drain the decode worker in this pod (its preStop hook)"),
    "operator": ("splitserve.operator.main", "run the Kubernetes operator"),
    "fetch-model": ("splitserve.core.model_uri", "download hf://ORG/NAME[@REVISION] into a directory (init container)"),
    "generate": ("splitserve.engine.cli", "generate text offline with the engine"),
    "demo-model": ("splitserve.engine.demo", "create the random-weight demo checkpoint and print its path"),
    "bench": ("splitserve.benchmark.serving", "load-test an OpenAI-compatible server"),
    "profile": ("splitserve.simulator.profile", "measure engine costs for the simulator"),
    "simulate": ("splitserve.simulator.main", "simulate a cluster and plan the prefill:decode split"),
}

# `splitserve bench TARGET ...` for component micro-benchmarks; anything else is
# the serving load generator.
BENCH_TARGETS: dict[str, str] = {
    "engine": "splitserve.benchmark.engine_vs_transformers",
    "kernels": "splitserve.benchmark.kernels",
    "kvtransfer": "splitserve.benchmark.kvtransfer",
    "router": "splitserve.benchmark.router_decision",
    "serve-overhead": "splitserve.benchmark.serve_overhead",
    "compare": "splitserve.benchmark.compare",
    "gpu-check": "splitserve.benchmark.gpu_check",
    "step-overhead": "splitserve.benchmark.step_overhead",
}


def _usage() -> str:
    lines = ["usage: splitserve COMMAND [ARGS]  (or --version)", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "  bench " + "|".join(BENCH_TARGETS) + "  component micro-benchmarks"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):  # the chart's appVersion (tests/image/test_version.py)
        print(f"splitserve {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"splitserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    if name == "bench" and rest and rest[0] in BENCH_TARGETS:
        module, rest = BENCH_TARGETS[rest[0]], rest[1:]
    try:
        entry = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            print(f"splitserve: command {name!r} is not available in this build ({module} missing)",
                  file=sys.stderr)
            return 2
        raise
    result = entry(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
