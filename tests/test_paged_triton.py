"""The Triton paged-attention kernel (`backend/paged_triton.py`) under Triton's interpreter on CPU, against a dense
float64 reference (`paged_triton_cases.py`, run once in a fresh process: TRITON_INTERPRET must be set before triton
is first imported, and this worker may have imported it through torch._inductor). The cases cover ragged limits
(1, a block boundary, nb * bs, 0), bs 8 and 16, random permuted tables, rows sharing blocks, GQA 1/2/4, a verify
block's causal tail, a draft block, head size 24 (a masked head dim), splits 1 and 3, fp32 and fp16; everything no
row may see is NaN. And the kernels build for an H100 (sm_90) without one: bf16 (which the interpreter cannot run),
fp16, fp32. Never run on a GPU here."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from domino_ray.backend import paged_triton

TESTS = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the dev extras install it)")
CASES = ["fp32_decode_bs8_ragged", "fp32_verify_bs16_gqa2", "fp32_draft_bs16_gqa4_shared_d24",
         "fp32_verify_bs8_gqa2_split1", "fp32_verify_bs8_gqa2_split3", "fp16_verify_bs16_gqa4",
         "fp16_verify_bs8_gqa2_split3"]
# fp32: the interpreter's dots are exact fp32, so only summation order differs. fp16: the softmax weights are
# rounded to fp16 before the value dot and the output is rounded to fp16, each a relative 2^-11 of sums bounded by
# max |value| (about 4 for these normal draws): 2 * 2^-11 * 4 = 3.9e-3.
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run([sys.executable, str(TESTS / "paged_triton_cases.py"), *CASES], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_matches_the_dense_reference(results, case):
    """Within tolerance of the reference; no NaN from the poisoned keys and blocks; zero-limit rows exactly 0."""
    got = results["cases"][case]
    assert got["finite"], f"{case}: a read outside the visible keys reached the output"
    assert got["zeros"], f"{case}: a row whose limits are all 0 is not zero"
    assert got["err"] <= TOLERANCE[case.split("_")[0]], (case, got["err"])


@needs_triton
def test_splits_agree(results):
    """Splitting a row's keys over 3 programs (one of them empty for the short row) and merging them by
    log-sum-exp gives the unsplit result."""
    one, three = (results["cases"][f"fp32_verify_bs8_gqa2_split{s}"]["out"] for s in (1, 3))
    assert max(abs(a - b) for a, b in zip(one, three)) <= 1e-5


@needs_triton
@pytest.mark.slow
def test_builds_for_h100_without_spills_and_with_pipelined_loads(tmp_path):
    """Each kernel, with the arguments `paged_attention` passes, lowers to an sm_90 cubin with triton's own ptxas
    (no GPU): no register spills (stack 0) at the warps `launch_config` picks, and the attention kernel's K/V loads
    become asynchronous copies: vectorized and pipelined, which a head-dim mask known only at run time prevents
    (scalar loads at twice the registers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(TESTS.parent), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(TESTS / "paged_triton_cases.py"), "--compile"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.splitlines()[-1])
    assert {"bfloat16_m8_d128_splits1_attend_kernel", "bfloat16_m68_d128_splits4_attend_kernel",
            "bfloat16_m68_d128_splits4_merge_kernel", "float32_m4_d128_splits1_attend_kernel",
            "bfloat16_m8_d128_splits1_wide_attend_kernel"} <= set(built)
    for name, usage in built.items():
        assert usage["stack"] == 0, (name, usage)
        assert usage["async_loads"] or name.endswith("_merge_kernel"), (name, usage)


def test_choose_splits_fills_about_two_programs_per_sm():
    assert paged_triton.choose_splits(rows=1, kv_heads=8, sm_count=132) == 16  # capped at max_splits
    assert paged_triton.choose_splits(rows=4, kv_heads=8, sm_count=132) == 8  # 32 programs * 8 = 256 <= 264
    assert paged_triton.choose_splits(rows=64, kv_heads=8, sm_count=132) == 1  # already 512 programs
    assert paged_triton.choose_splits(rows=2, kv_heads=4, sm_count=132, max_splits=4) == 4
    for rows in range(1, 40):
        splits = paged_triton.choose_splits(rows, 8, 132)
        assert 1 <= splits <= 16 and (splits == 1 or rows * 8 * splits <= 2 * 132)


def test_not_available_off_cuda_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not paged_triton.available("cpu")


@needs_triton
def test_imports_and_says_unavailable_without_triton(results):
    """With `import triton` failing (in the cases' process, before it imports triton), the module imports and
    `available` is False for CUDA and for the interpreter."""
    assert results["without_triton"]


@needs_triton
def test_the_engine_on_the_triton_kernel_gives_the_targets_tokens():
    """The engine with its attention on our Triton kernel (as on CUDA, here under the interpreter): greedy speculative
    and target-only equal HF's tokens over ragged rows in a small pool, prompts in chunks; the wiring (int32 tables,
    folded limits, the draft's pool) is the engine's own."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run([sys.executable, str(TESTS / "paged_triton_engine.py")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["kernel_calls"] > 0 and got["table_dtypes"] == ["torch.int32"]
    assert got["target_only"]["tokens"] == got["hf"]
    assert got["speculative"]["tokens"] == got["hf"]
