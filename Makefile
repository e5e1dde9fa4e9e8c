# The two commands of the README: `make serve` and `make test`. Both set up a
# fresh clone themselves (system packages, .venv, pinned torch, the package).
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.splitserve-installed
PROTOS := $(wildcard splitserve/proto/*.proto)

# Bytecode is cached (__pycache__, git-ignored) even where the environment says not to:
# with PYTHONDONTWRITEBYTECODE=1 every pytest process and every process a test starts
# recompiled splitserve and re-rewrote the test modules' asserts (collection 27 s against
# 12 s warm here, per xdist worker).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup serve test test-fast test-full test-times lint chaos bench-engine bench-router bench-kvtransfer clean

$(STAMP): pyproject.toml scripts/setup.sh $(PROTOS)
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

# Serve the built-in demo model (random weights) on http://127.0.0.1:8000
serve: $(STAMP)
	$(BIN)/splitserve serve $(ARGS)

# The whole suite on two xdist workers, one unit (a module, or a directory sharing a session
# fixture) per worker at a time, longest first; fails past its time budget (docs/testing.md).
PYTEST    := $(BIN)/python -m pytest -q -p no:cacheprovider
PARALLEL  ?= -n 2 --dist loadscope --no-loadscope-reorder
test: $(STAMP)
	$(BIN)/ruff check splitserve tests bench
	SPLITSERVE_TEST_BUDGET=enforce $(PYTEST) $(PARALLEL) -m "not full" $(PYTEST_ARGS)

# The edit loop: unit and in-process tests, no serving stack started (about 2.5 minutes on the
# machine the budgets were set on, 7.7 on 2026-12-07's 3.2x slower one: docs/testing.md).
test-fast: $(STAMP)
	$(PYTEST) $(PARALLEL) -m "not slow and not full" $(PYTEST_ARGS)

# Everything, the full kernel sweeps included (marker full).
test-full: $(STAMP)
	$(BIN)/ruff check splitserve tests bench
	$(PYTEST) $(PARALLEL) $(PYTEST_ARGS)

# Refresh the per-module times that order the parallel units (tests/suite/module_seconds.json).
test-times: $(STAMP)
	SPLITSERVE_TEST_TIMES=tests/suite/module_seconds.json $(PYTEST) -m "not full" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check splitserve tests bench
	$(BIN)/lint-imports

# The chaos suite (part of `make test`) with a 10x client-reset storm; docs/reliability.md
chaos: $(STAMP)
	SPLITSERVE_CHAOS_RESETS=1000 $(BIN)/python -m pytest -q -p no:cacheprovider -s tests/chaos

# Engine against transformers (static batching), 64 requests; see docs/benchmarks.md
bench-engine: $(STAMP)
	$(BIN)/splitserve bench engine --out bench/results/engine_vs_transformers.json

# Routing decision latency: 2,048-token prompt, 64 workers, ~1M-block index
bench-router: $(STAMP)
	$(BIN)/splitserve bench router --json bench/results/router_decision.json

# KV transfer against a raw TCP socket, both backends, 64 MB and 512 MB
bench-kvtransfer: $(STAMP)
	for b in grpc mooncake; do for mb in 64 512; do \
	  $(BIN)/splitserve bench kvtransfer --backend $$b --size-mb $$mb --repeat 7 \
	    --json bench/results/kvtransfer_$${b}_$${mb}mb.json || exit 1; done; done

clean:
	rm -rf $(VENV) build *.egg-info

# Serving experiments and the simulator (issue 7); results in bench/results/, notes in docs/experiments.md
.PHONY: bench-prefix-routing bench-disagg bench-simulator bench-simulator-speed
bench-prefix-routing: $(STAMP)
	$(BIN)/python -m bench.experiments.prefix_routing

bench-disagg: $(STAMP)
	$(BIN)/python -m bench.experiments.disagg_vs_colocated

bench-simulator: $(STAMP)
	$(BIN)/python -m bench.experiments.simulator_validation --reprofile

bench-simulator-speed: $(STAMP)
	$(BIN)/python -m bench.experiments.simulator_speed

# Structured outputs: tokens/s with and without a JSON schema, batch 1 and 32 (docs/benchmarks.md)
.PHONY: bench-structured
bench-structured: $(STAMP)
	$(BIN)/python -m bench.experiments.structured_overhead

# Native CPU small ops against the torch reference: decode step time, batch 1..32 (docs/benchmarks.md)
.PHONY: bench-cpu-small-ops
bench-cpu-small-ops: $(STAMP)
	$(BIN)/python -m bench.experiments.cpu_small_ops
