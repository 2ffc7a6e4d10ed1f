# The two commands (README): `make demo` sets up and runs the batch job on the embedded default;
# `make test` sets up and runs the whole test suite. Both work on a fresh CPU-only machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

# The batch job on the default (demo) config, with the target-only comparison for the speed-up.
# Extra overrides: make demo ARGS="generation.max_new_tokens=32".
demo: setup
	$(BIN)/python jobs/generate.py runtime.compare_baseline=true $(ARGS)

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_engine_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
