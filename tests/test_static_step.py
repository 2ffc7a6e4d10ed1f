"""The fixed-shape step: padding rows are inert, one host sync per decode step, no K/V head copies,
traceable as one graph per bucket (the CPU-side evidence that CUDA-graph capture works)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from domino_ray.engine.memory import check_memory_fits
from domino_ray.engine.request import Request
from domino_ray.engine.core import SpecEngine
from domino_ray.spec_decode.draft import gru_cell
from domino_ray.spec_decode.proposer import DominoProposer
from domino_ray.sample.params import SamplingParams
from oracles import OracleProposer
from tiny_models import ragged_prompts, tiny_draft, tiny_target

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.cpu, torch.Tensor.nonzero,
         torch.nonzero, torch.Tensor.numpy}


class SyncCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.syncs += func in SYNCS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


def run(target, proposer, prompts, params, max_rows, pad_rows=False):
    """`pad_rows`: pad each step's rows up to a row bucket, as with CUDA graphs; eagerly (otherwise) no step
    runs a padding row."""
    engine = SpecEngine(target, proposer, max_rows=max_rows)
    engine.pad_rows, padded, device_step = pad_rows, [], engine._device_step

    def recording(r, *args):
        padded.append(r > len(engine.rows))
        return device_step(r, *args)
    engine._device_step = recording
    out = engine.generate([Request(i, p, params[i % len(params)]) for i, p in enumerate(prompts)])
    assert pad_rows or not any(padded), padded
    if pad_rows and len(prompts) in (3, 5):  # their first steps pad (3 rows in bucket 4, 5 in 8)
        assert padded[0], padded
    return out


def row_view(c):
    stats = {k: v for k, v in c.stats.to_columns().items()}
    return c.token_ids, c.finish_reason, stats


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_padding_rows_never_change_real_rows(target, rows):
    """Rows padded up to a bucket as CUDA graphs pad them (17 rows in 17 slots: bucket 17; 5 in bucket 8; 3 in
    bucket 4) give the same tokens and statistics as each row alone in a one-slot engine (no padding at all)."""
    prompts = ragged_prompts(rows, seed=rows, max_len=20)
    greedy, sampled = SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)
    draft = tiny_draft(target, block_size=4)
    together = run(target, DominoProposer(draft, target), prompts, [greedy, sampled], max_rows=17, pad_rows=True)
    for i, p in enumerate(prompts):
        (alone,) = run(target, DominoProposer(draft, target), [p], [[greedy, sampled][i % 2]], max_rows=1)
        assert row_view(together[i]) == row_view(alone), i


def steady_state_syncs(engine, prompts, params) -> list[int]:
    for i, p in enumerate(prompts):
        engine.add_request(Request(i, p, params))
    engine.step()  # admission (its own syncs) + the first decode step
    counts = []
    while engine.has_unfinished():
        counter = SyncCounter()
        with counter:
            engine.step()
        counts.append(counter.syncs)
    return counts


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.9, 1.0), (0.9, 0.8)])
@pytest.mark.parametrize("speculative", [False, True])
def test_one_host_sync_per_decode_step(target, temperature, top_p, speculative):
    proposer = DominoProposer(tiny_draft(target, block_size=4), target) if speculative else None
    engine = SpecEngine(target, proposer, max_rows=4)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, seed=1, ignore_eos=True)
    counts = steady_state_syncs(engine, ragged_prompts(3, seed=4), params)
    assert len(counts) >= 2 and max(counts) == 1, counts


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_hf_repeat_kv_never_runs_in_the_engine(kind, monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    calls = []
    for module in (sdpa, llama, qwen3):
        original = module.repeat_kv
        monkeypatch.setattr(module, "repeat_kv", lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    model = tiny_target(kind, seed=1)
    prompts = ragged_prompts(3, seed=2)
    run(model, DominoProposer(tiny_draft(model, block_size=4), model), prompts, [SamplingParams(max_new_tokens=8)],
        max_rows=4)
    assert calls == []
    # The probe works: HF's own forward with a padding mask does call it.
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))
    assert calls


def test_compiled_steps_are_one_graph_without_recompiles(target):
    """torch.compile(fullgraph=True) traces the draft step and the verify step of one bucket as single graphs,
    and 20 consecutive steps in that bucket reuse them (no recompilation)."""
    import torch._dynamo

    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    draft = tiny_draft(target, block_size=4)
    engine = SpecEngine(target, DominoProposer(draft, target), max_rows=4, max_model_len=200)
    engine.runner.draft = torch.compile(engine.runner.draft, fullgraph=True, backend=backend)
    engine.runner.verify = torch.compile(engine.runner.verify, fullgraph=True, backend=backend)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    for i, p in enumerate(ragged_prompts(3, seed=9, max_len=10)):
        engine.add_request(Request(i, p, params))
    # The step never calls nn.GRU (it holds the weights for the explicit cell), but dynamo refuses to even
    # read an nn.GRU's parameters unless told that RNN modules are allowed.
    with torch._dynamo.config.patch(allow_rnn=True):
        for _ in range(21):
            engine.step()
    assert len(engine.rows) == 3  # every step ran with the same 3 rows (their lengths grew: not in the graphs)
    assert len(compiles) == 2, [len(g.graph.nodes) for g in compiles]
    torch._dynamo.reset()


def test_gru_cell_equals_nn_gru():
    torch.manual_seed(0)
    gru = torch.nn.GRU(24, 16, batch_first=True, bias=False)
    x, h = torch.randn(5, 7, 24), torch.randn(1, 5, 16)
    expected, _ = gru(x, h)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 3e-2)):
        state = h[0].to(dtype)
        w_ih, w_hh = gru.weight_ih_l0.to(dtype), gru.weight_hh_l0.to(dtype)
        for t in range(x.shape[1]):
            state = gru_cell(x[:, t].to(dtype), state, w_ih, w_hh)
            assert torch.allclose(state.float(), expected[:, t], atol=tol), (dtype, t)


def test_cuda_graphs_setting_is_checked(target):
    with pytest.raises(ValueError, match="cuda_graphs=on needs a CUDA device"):
        SpecEngine(target, None, max_rows=2, cuda_graphs="on")
    with pytest.raises(ValueError, match="must be one of auto, on, off"):
        SpecEngine(target, None, max_rows=2, cuda_graphs="yes")
    assert SpecEngine(target, None, max_rows=2, cuda_graphs="auto").graphs is None  # CPU: eager


def test_oracle_padding_rows(target):
    """A non-capturable proposer (host-side drafts) works in padded buckets too."""
    prompts = ragged_prompts(3, seed=11)
    base = run(target, None, prompts, [SamplingParams(max_new_tokens=9)], max_rows=4)
    refs = {i: p + c.token_ids for i, (p, c) in enumerate(zip(prompts, base))}
    out = run(target, OracleProposer(refs, 3, target.config.vocab_size), prompts, [SamplingParams(max_new_tokens=9)],
              max_rows=4)
    assert [c.token_ids for c in out] == [c.token_ids for c in base]
    assert all(c.stats.mean_acceptance_length > 2 for c in out)


def test_memory_plan_counts_every_preallocation_and_names_the_keys(target):
    engine = SpecEngine(target, DominoProposer(tiny_draft(target, block_size=4), target), max_rows=4,
                        max_model_len=100)
    plan = engine.memory_plan()
    kv = engine.runner.kv
    assert plan["kv_pool"] == sum(t.numel() * t.element_size() for t in (*kv.keys, *kv.values)) \
        + engine.proposer.kv.nbytes and engine.proposer.kv.nbytes > 0
    assert plan["block_tables"] == engine.runner.block_tables.nbytes
    assert plan["draft_rope"] == engine.proposer.rope_cos.nbytes + engine.proposer.rope_sin.nbytes > 0
    assert plan["target_rope"] == sum(t.nbytes for t in engine.runner.cos_sin) > 0
    assert plan["decode_step"] > 0 and plan["prefill_peak"] > 0
    check_memory_fits(plan, 2 * sum(plan.values()), "cuda:0")
    with pytest.raises(ValueError, match="lower generation.kv_cache_tokens, generation.max_batch_size or "
                                         "generation.max_prefill_tokens"):
        check_memory_fits(plan, sum(plan.values()), "cuda:0")
