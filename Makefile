# The two commands of the README: `make serve` and `make test`. Both set up a
# fresh clone themselves (system packages, .venv, pinned torch, the package).
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.splitserve-installed
PROTOS := $(wildcard splitserve/proto/*.proto)

.PHONY: setup serve test lint bench-engine clean

$(STAMP): pyproject.toml scripts/setup.sh $(PROTOS)
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

# Serve the built-in demo model (random weights) on http://127.0.0.1:8000
serve: $(STAMP)
	$(BIN)/splitserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check splitserve tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check splitserve tests bench

# Engine against transformers (static batching), 64 requests; see docs/benchmarks.md
bench-engine: $(STAMP)
	$(BIN)/python bench/engine_vs_transformers.py --out bench/results/engine_vs_transformers.json

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
