"""Penalties, min_tokens, logprobs and stop strings in the engine: against HF transformers' own implementation
(repetition_penalty, min_new_tokens, the target's log-softmax) or a step-by-step host reference of the formulas
(presence/frequency), and speculative (a fixed K and the adaptive width) == target-only, with drafts accepted.

The agreeing pair's target follows a cycle, so penalties change its output (checked: a test where they did not
would prove nothing), and its draft is mostly accepted, so the penalties meet real block positions."""

import pytest
import torch

from domino_ray.engine.request import Request
from domino_ray.llm import build_engine
from domino_ray.target.loading import decode, load_target, load_tokenizer, stop_token_ids
from domino_ray.frontend.detokenizer import StopStrings
from domino_ray.spec_decode.checkpoint import load_draft
from domino_ray.sample.params import SamplingParams
from speculation import FixedCosts
from tiny_models import ragged_prompts, save_agreeing_pair

K = 4
LOGPROB_TOL = 1e-9  # float64 target: the engine's log-softmax and a plain forward's differ by rounding only


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = save_agreeing_pair(tmp_path_factory.mktemp("agreeing"), block_size=K + 1)
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    draft = load_draft(draft_dir, target_config=target.config, dtype=target.dtype)
    return target, tokenizer, draft


def engine(pair, kind: str, rows: int = 4):
    """target-only, a fixed K, or the adaptive width on a fixed cost table (drafting cheap: it drafts)."""
    target, tokenizer, draft = pair
    if kind == "target":
        return build_engine(target, None, tokenizer, max_batch_size=rows)
    costs = FixedCosts({r: {w: 1.0 + 0.1 * w for w in range(K + 1)} for r in (1, 2, 4, rows)})
    return build_engine(target, draft, tokenizer, max_batch_size=rows, num_draft_tokens=K if kind == "fixed" else "auto",
                        **({"width_costs": costs} if kind == "auto" else {}))


def run(pair, kind, prompts, params, rows=4):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return engine(pair, kind, rows).generate([Request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])


def accepted(completions) -> int:
    return sum(c.stats.num_accepted_draft_tokens for c in completions)


PROMPTS = ragged_prompts(6, seed=11, max_len=12)


@pytest.fixture(scope="module")
def echo_prompts(pair):
    """PROMPTS led by the first 10 tokens of their own greedy continuation: the rows stop within 4 to 12 tokens,
    so only a penalty over the prompt's tokens can change them."""
    plain = run(pair, "target", PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True))
    return [c.token_ids + p for c, p in zip(plain, PROMPTS)]


def hf_generate(target, prompt, sp: SamplingParams, stops) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=sp.max_new_tokens,
                          min_new_tokens=sp.min_tokens or None, repetition_penalty=sp.repetition_penalty,
                          eos_token_id=sorted(stops), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5), dict(min_tokens=24),
                                       dict(repetition_penalty=0.7, min_tokens=10)])
def test_repetition_penalty_and_min_tokens_equal_hf_generate(pair, echo_prompts, penalties):
    """Fails if the penalty skips the prompt's tokens, misses a draft position's counts (speculative only), or
    min_tokens counts generated tokens from 1 rather than 0."""
    target, tokenizer, _ = pair
    stops = stop_token_ids(target, tokenizer)
    sp = SamplingParams(max_new_tokens=32, **penalties)
    reference = [hf_generate(target, p, sp, stops) for p in echo_prompts]
    plain = [c.token_ids for c in run(pair, "target", echo_prompts, SamplingParams(max_new_tokens=32))]
    assert plain != reference  # the penalties change the output
    if "min_tokens" in penalties:  # some row would have stopped before min_tokens
        assert any(len(t) < sp.min_tokens and t[-1] in stops for t in plain), plain
    assert [c.token_ids for c in run(pair, "target", echo_prompts, sp)] == reference
    for kind in ("fixed", "auto"):
        spec = run(pair, kind, echo_prompts, sp)
        assert [c.token_ids for c in spec] == reference, kind
        assert accepted(spec) > 0, kind


def host_reference(target, prompt, sp: SamplingParams, stops) -> list[int]:
    """vLLM's order, one plain forward per token: min_tokens, repetition (prompt + generated), frequency and
    presence (OpenAI: generated only), then the argmax."""
    generated = []
    while len(generated) < sp.max_new_tokens:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + generated])).logits[0, -1].clone()  # [V]
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).to(logits.dtype)
        if len(generated) < sp.min_tokens:
            logits[sorted(stops)] = float("-inf")
        seen = counts > 0
        seen[prompt] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / sp.repetition_penalty,
                                               logits * sp.repetition_penalty), logits)
        logits = logits - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
        generated.append(int(logits.argmax()))
        if generated[-1] in stops:
            break
    return generated


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=0.8, ignore_eos=True),
                                       dict(presence_penalty=1.5, ignore_eos=True),
                                       dict(frequency_penalty=-1.0, ignore_eos=True),
                                       dict(presence_penalty=-1.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                            min_tokens=20)])
def test_presence_and_frequency_penalties_equal_the_openai_formula(pair, penalties):
    """Penalised rows beside plain ones in one batch: the penalised equal the host reference, the plain ones their
    own output (a row's penalties never leak). Without EOS the rows fall into a 15-token loop within 13 to 30
    tokens, where the generated counts matter; negative penalties make a row repeat its own tokens (the first
    one included), so counts pass 1. Fails if the counts include the prompt, if presence weighs counts, or if
    the counts miss the prefill's first token or a step's committed tokens."""
    target, tokenizer, _ = pair
    stops = stop_token_ids(target, tokenizer)
    sp = SamplingParams(max_new_tokens=48, **penalties)
    plain_sp = SamplingParams(max_new_tokens=48, ignore_eos=sp.ignore_eos)
    stops = set() if sp.ignore_eos else stops
    reference = [host_reference(target, p, sp, stops) for p in PROMPTS]
    plain = [c.token_ids for c in run(pair, "target", PROMPTS, plain_sp)]
    assert plain != reference
    mixed = [sp if i % 2 == 0 else plain_sp for i in range(len(PROMPTS))]
    expected = [reference[i] if i % 2 == 0 else plain[i] for i in range(len(PROMPTS))]
    for kind in ("target", "fixed", "auto"):
        out = run(pair, kind, PROMPTS, mixed)
        assert [c.token_ids for c in out] == expected, kind
        assert kind == "target" or accepted(out) > 0, kind


def test_device_counts_follow_the_rows_through_steps_and_slot_moves(pair):
    """After every step each active row's slot holds its generated tokens' counts and number, its prompt's tokens
    and (min_tokens) its stop ids, while rows finish at different steps and the others move into their slots.
    Fails if the prefill's first token is not counted, a step's committed tokens are missed, or a slot move
    leaves the penalties' state behind."""
    target, tokenizer, _ = pair
    eng = engine(pair, "fixed", rows=3)
    prompts = ragged_prompts(7, seed=5, max_len=20)
    for i, p in enumerate(prompts):
        eng.add_request(Request(i, p, SamplingParams(max_new_tokens=6 + 5 * i, frequency_penalty=0.1 * (i % 3),
                                                     min_tokens=i % 4, temperature=0.5 * (i % 2), seed=i,
                                                     ignore_eos=i % 3 != 0)))
    state, moves, checked, done = eng.runner.sampling.penalties, [], 0, []
    move = eng.runner.move_slots
    eng.runner.move_slots = lambda *a: (moves.append(a), move(*a))[1]
    while eng.has_unfinished():
        done += [e.completion for e in eng.step() if e.completion is not None]
        for slot, row in enumerate(eng.rows):
            v = target.config.vocab_size
            counts = torch.bincount(torch.tensor(row.tokens), minlength=v)
            assert state.counts[slot].tolist() == counts.tolist() and int(state.generated[slot]) == len(row.tokens)
            assert state.prompt[slot].nonzero()[:, 0].tolist() == sorted(set(row.request.prompt_token_ids))
            stops = sorted(row.stop_ids) if row.request.params.min_tokens else []
            assert state.stop[slot].nonzero()[:, 0].tolist() == stops
            checked += 1
    assert moves and checked >= 15 and accepted(done) > 0


def test_sampled_rows_with_penalties_speculative_equal_target_only_per_seed(pair):
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, seed=100 + i, repetition_penalty=1.3,
                             frequency_penalty=0.3, presence_penalty=0.2, min_tokens=4, top_k=20 if i % 2 else 0)
              for i in range(len(PROMPTS))]
    base = run(pair, "target", PROMPTS, params)
    unpenalized = run(pair, "target", PROMPTS, [SamplingParams(max_new_tokens=30, temperature=0.8, seed=100 + i,
                                                               top_k=20 if i % 2 else 0) for i in range(len(PROMPTS))])
    assert [c.token_ids for c in base] != [c.token_ids for c in unpenalized]
    for kind in ("fixed", "auto"):
        spec = run(pair, kind, PROMPTS, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in base], kind
        assert accepted(spec) > 0, kind


def reference_logprobs(target, prompt, generated) -> torch.Tensor:
    """log_softmax of a plain forward over prompt + generated at the positions that chose each generated token."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]  # [m, V]
    return logits.double().log_softmax(-1)


def check_logprobs(target, c, top: int):
    ref = reference_logprobs(target, c.prompt_token_ids, c.token_ids)
    assert len(c.logprobs) == len(c.token_ids)
    for token, entry, lp in zip(c.token_ids, c.logprobs, ref):
        assert len(entry) == 1 + top and entry[0][0] == token
        assert abs(entry[0][1] - float(lp[token])) < LOGPROB_TOL
        best = lp.topk(top)
        values = [v for _, v in entry[1:]]
        assert values == sorted(values, reverse=True)
        assert max((abs(v - float(b)) for v, b in zip(values, best.values)), default=0) < LOGPROB_TOL
        for (i, v), j in zip(entry[1:], best.indices.tolist()):
            assert i == j or abs(float(lp[i]) - float(lp[j])) < LOGPROB_TOL  # ties aside
            assert abs(float(lp[i]) - v) < LOGPROB_TOL


def test_logprobs_are_the_targets_raw_log_softmax(pair):
    """Rows with logprobs 5, 0 and none, greedy, sampled and penalised (logprobs stay raw: before penalties and
    temperature), in one batch: each token's entry equals a plain forward's log-softmax, speculative equals
    target-only, and the step events carry the same entries. Fails if the logprobs were taken after the
    penalties or at the wrong position, or if a row got another row's N."""
    target = pair[0]
    asks = [5, 0, None, 3, 20, None]
    params = [SamplingParams(max_new_tokens=20, logprobs=n, temperature=0.7 if i % 3 == 1 else 0.0, seed=i,
                             repetition_penalty=1.4 if i == 3 else 1.0) for i, n in enumerate(asks)]
    outs = {}
    for kind in ("target", "fixed", "auto"):
        events = {}
        completions = engine(pair, kind).generate(
            [Request(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))],
            on_event=lambda e: events.setdefault(e.request_id, []).extend(e.new_logprobs or []))
        for c, n in zip(completions, asks):
            if n is None:
                assert c.logprobs is None and not events.get(c.request_id)
            else:
                check_logprobs(target, c, n)
                assert events[c.request_id] == c.logprobs
        outs[kind] = completions
        assert kind == "target" or accepted(completions) > 0
    for kind in ("fixed", "auto"):
        assert [c.token_ids for c in outs[kind]] == [c.token_ids for c in outs["target"]]
        for c, base in zip(outs[kind], outs["target"]):
            for entry, ref in zip(c.logprobs or [], base.logprobs or []):
                assert [i for i, _ in entry] == [i for i, _ in ref] or entry[0] == ref[0]  # ties aside
                assert max(abs(a - b) for (_, a), (_, b) in zip(entry, ref)) < LOGPROB_TOL


# ---- stop strings ---------------------------------------------------------------------------------


class RecordingSteps:
    """Each decode step's committed tokens per row as the device gave them (before any host cut)."""

    def __init__(self, eng):
        self.steps, read = [], eng.runner.read_output

        def recording(n, w, logprobs=None, forced=()):
            out = read(n, w, logprobs, forced)
            self.steps.append([out.committed(i) for i in range(n)])
            return out
        eng.runner.read_output = recording


def stop_string_for(tokenizer, tokens, index: int, span: bool) -> str | None:
    """A stop string that first completes at token `index`: its own text, or (`span`) the last two characters
    before it and its first; None when there is no such string."""
    before, through = decode(tokenizer, tokens[:index]), decode(tokenizer, tokens[:index + 1])
    if not through.startswith(before) or len(through) == len(before) or (span and len(before) < 2):
        return None
    stop = through[len(before) - 2:len(before) + 1] if span else through[len(before):]
    return stop if stop.strip() and through.find(stop) == len(through) - len(stop) else None


@pytest.mark.parametrize("span", [False, True])
def test_stop_string_completing_inside_an_accepted_run_ends_the_row_on_that_step(pair, span):
    """A stop string whose last token is an accepted draft with more accepted tokens after it in the step: the
    row keeps the tokens through that one, finishes "stop" and leaves the engine on that very step, and its
    statistics count only what it kept. Fails if the engine keeps the step's later tokens or ends the row a step
    late."""
    tokenizer = pair[1]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    found = None
    for prompt in PROMPTS:
        eng = engine(pair, "fixed", rows=1)
        recording = RecordingSteps(eng)
        (c,) = eng.generate([Request(0, prompt, sp)])
        done = 1  # the prefill's first token
        for step, (committed,) in enumerate(recording.steps):
            for j in range(1, len(committed) - 1):  # an accepted draft (not the step's first) with more after it
                stop = stop_string_for(tokenizer, c.token_ids, done + j, span)
                if stop is not None and found is None:
                    found = (prompt, stop, step, done + j + 1, c.token_ids)
            done += len(committed)
    assert found is not None
    prompt, stop, stop_step, kept, tokens = found
    stopped = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop,))
    eng = engine(pair, "fixed", rows=1)
    recording = RecordingSteps(eng)
    eng.add_request(Request(0, prompt, stopped, stop_strings=StopStrings(tokenizer, stopped.stop)))
    completion, decode_steps = None, 0
    while completion is None:
        events = eng.step()
        decode_steps = len(recording.steps)
        completion = next((e.completion for e in events if e.completion is not None), None)
    assert decode_steps == stop_step + 1 and not eng.has_unfinished()  # it left on the step its string completed
    assert completion.finish_reason == "stop" and completion.token_ids == tokens[:kept]
    assert len(recording.steps[-1][0]) > len(events[0].new_token_ids)  # the step's later accepted tokens dropped
    stats = completion.stats
    assert len(completion.token_ids) == 1 + stats.num_spec_steps + stats.num_accepted_draft_tokens
    assert stop in decode(tokenizer, completion.token_ids) and stop not in decode(tokenizer, completion.token_ids[:-1])
