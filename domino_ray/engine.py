"""The batched speculative engine: ragged rows, per-row KV offsets, continuous batching.

Token ids in, token ids out: no text, no IO, no Ray. One engine serves a list of requests with a fixed
number of slots; a finished row frees its slot and the next pending request is prefilled into it.

Glossary (shape comments): n active rows (at most R slots), q query positions, T buffer positions,
K draft tokens per step, B draft block size, V vocabulary, C hidden size, F = len(target_layer_ids) * C.
Speculative-decoding words (draft tokens, accepted, bonus, step) are defined in `verify.py`.

A row's committed tokens are prompt + generated. Its last committed token, the *anchor*, has not been
through the target yet: the target KV holds positions `[0, lens)` with `lens = committed - 1`, and so
does the draft's context. One step, for all active rows at once:
  1. draft:  the proposer turns each anchor into K draft tokens                       -> [n, K]
  2. verify: one target forward over `[anchor, d_1..d_K]` at positions `lens + 0..K`  -> [n, K+1, V]
  3. accept: `verify.py` picks a (accepted) and the bonus; `lens += a + 1`; the hidden states of the
     a + 1 newly committed positions become the draft's new context. Rejected positions stay in the
     buffers beyond `lens` and are overwritten next step: nothing is cropped.
  4. one host sync: accepted counts and tokens; stop checks, statistics, finished rows leave.
Target-only decoding is the same loop with K = 0 (no proposer): the baseline.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import torch

from domino_ray.kv_cache import KVBuffers, RowKVCache, causal_row_mask, write_index
from domino_ray.sampling import SamplingParams, sampling_probs
from domino_ray.stats import RowStats
from domino_ray.verify import greedy_accept, rejection_accept, sample_from_probs


@dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]             # generated tokens, the stop token included when one ended the row
    finish_reason: str               # "stop" | "length" | "abort"
    stats: RowStats
    time_to_first_token_s: float     # from add_request to the first token on the host
    time_taken_s: float              # from add_request to the last token


@dataclass
class StepEvent:
    request_id: Hashable
    new_token_ids: list[int]         # tokens committed for this request in this step (for streaming)
    completion: Completion | None    # set when the request finished in this step


@dataclass
class _Row:
    request: Request
    max_new: int                     # generated tokens allowed (max_new_tokens capped by the model length)
    stop_ids: frozenset
    generator: torch.Generator | None  # per-row randomness for sampled decoding
    stats: RowStats
    arrival: float
    tokens: list[int] = field(default_factory=list)
    first_token_time: float = 0.0
    finish_reason: str | None = None

    @property
    def committed(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.tokens)


class SpecEngine:
    """Batched speculative (or, without a proposer, target-only) generation on one device."""

    def __init__(self, target, proposer=None, *, max_rows: int = 16, max_model_len: int | None = None,
                 eos_token_ids: Iterable[int] = (), seed: int = 0, max_prefill_tokens: int = 8192):
        cfg = target.config
        self.target, self.decoder, self.lm_head = target, target.get_decoder(), target.get_output_embeddings()
        self.proposer = proposer
        self.num_draft_tokens = proposer.num_draft_tokens if proposer is not None else 0
        limits = [x for x in (max_model_len, getattr(cfg, "max_position_embeddings", None)) if x]
        if not limits:
            raise ValueError("max_model_len is required: the target config has no max_position_embeddings")
        self.max_model_len = min(limits)
        self.vocab_size = cfg.vocab_size
        self.max_rows, self.max_prefill_tokens = max_rows, max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        weight = next(target.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        capacity = self.max_model_len + self.num_draft_tokens + 1  # a verify may write K+1 past the last token
        _check_kv_fits(self.device, max_rows, capacity,
                       2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * weight.element_size())
        self.kv = KVBuffers(cfg.num_hidden_layers, max_rows, capacity, cfg.num_key_value_heads, head_dim,
                            weight.dtype, self.device)
        self.cache = RowKVCache(self.kv)
        self.hidden_ids = None
        if proposer is not None:
            proposer.allocate(max_rows, capacity)
            layer_ids = list(proposer.target_layer_ids)
            bad = [i for i in layer_ids if not 0 <= i < cfg.num_hidden_layers]
            if bad:
                raise ValueError(f"draft target_layer_ids {layer_ids} out of range for a target with "
                                 f"{cfg.num_hidden_layers} layers: {bad}")
            self.hidden_ids = [i + 1 for i in layer_ids] or None  # HF hidden_states[l + 1] = output of layer l
        r, dev = max_rows, self.device
        self.lens = torch.zeros(r, dtype=torch.long, device=dev)       # [R] committed positions in the KV
        self.anchor = torch.zeros(r, dtype=torch.long, device=dev)     # [R] last committed token
        self.remaining = torch.zeros(r, dtype=torch.long, device=dev)  # [R] tokens the row may still emit
        self.temperature = torch.zeros(r, device=dev)                 # [R]
        self.top_p = torch.ones(r, device=dev)                        # [R]
        self.top_k = torch.zeros(r, dtype=torch.long, device=dev)     # [R]
        self.rows: list[_Row] = []      # active rows; rows[i] lives in slot i
        self.pending: deque[_Row] = deque()
        self._running_ids: set = set()  # request ids of pending and active rows
        self.rng = torch.Generator().manual_seed(seed)

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request):
        """Queue a request; raises ValueError (naming the field) for a request that cannot run."""
        ids, params = request.prompt_token_ids, request.params
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be ints in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's limit is {self.max_model_len} "
                             "tokens including at least one generated token")
        if request.request_id in self._running_ids:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params.validate()
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.rng))
            generator = torch.Generator().manual_seed(seed)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        self._running_ids.add(request.request_id)
        self.pending.append(_Row(request=Request(request.request_id, list(ids), params),
                                 max_new=min(params.max_new_tokens, self.max_model_len - len(ids)),
                                 stop_ids=frozenset(stop), generator=generator,
                                 stats=RowStats(self.num_draft_tokens), arrival=time.perf_counter()))

    def abort(self, request_id: Hashable) -> bool:
        """Drop a pending request or end an active one at the next step (its slot is freed then)."""
        for row in self.pending:
            if row.request.request_id == request_id:
                self.pending.remove(row)
                self._running_ids.discard(request_id)
                return True
        for row in self.rows:
            if row.request.request_id == request_id and row.finish_reason is None:
                row.finish_reason = "abort"
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.pending)

    def generate(self, requests: Iterable[Request], on_event: Callable[[StepEvent], None] | None = None
                 ) -> list[Completion]:
        """Run requests to completion with continuous batching; completions in request order."""
        order = []
        for req in requests:
            self.add_request(req)
            order.append(req.request_id)
        done = {}
        while self.has_unfinished():
            for event in self.step():
                if on_event:
                    on_event(event)
                if event.completion is not None:
                    done[event.request_id] = event.completion
        return [done[rid] for rid in order]

    # ---- the loop ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit pending requests into free slots, then one speculative step for all active rows."""
        events: list[StepEvent] = []
        self._evict(events)  # aborted rows free their slots first
        self._admit(events)
        self._evict(events)
        if self.rows:
            self._decode(events)
            self._evict(events)
        return events

    def _admit(self, events: list[StepEvent]):
        batch, longest = [], 0
        while self.pending and len(self.rows) + len(batch) < self.max_rows:
            m = len(self.pending[0].request.prompt_token_ids)
            if batch and (len(batch) + 1) * max(longest, m) > self.max_prefill_tokens:
                break
            batch.append(self.pending.popleft())
            longest = max(longest, m)
        if not batch:
            return
        batch.sort(key=lambda r: len(r.request.prompt_token_ids))  # rows are independent: any slot order works
        lo, firsts = len(self.rows), []
        for group in _length_groups(batch):
            firsts.append(self._prefill(group, slice(lo, lo + len(group))))
            lo += len(group)
        first_tokens = torch.cat(firsts).tolist()  # host sync: the admitted rows' first tokens
        now = time.perf_counter()
        for row, token in zip(batch, first_tokens):
            row.first_token_time = now
            self.rows.append(row)
            self._commit(row, [token], events, now)

    def _prefill(self, batch: list[_Row], rows: slice) -> torch.Tensor:
        """One target forward over right-padded prompts into slots `rows`; returns first tokens `[k]`."""
        k, longest = len(batch), max(len(r.request.prompt_token_ids) for r in batch)
        ids = torch.zeros(k, longest, dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row.request.prompt_token_ids)] = torch.tensor(row.request.prompt_token_ids)
        lengths = torch.tensor([len(r.request.prompt_token_ids) for r in batch], device=self.device)  # [k]
        zeros = torch.zeros(k, dtype=torch.long, device=self.device)
        positions = write_index(zeros, longest)  # [k, q]
        self.cache.prepare(rows, zeros, longest, longest, prefill=True)
        out = self.decoder(input_ids=ids.to(self.device), position_ids=positions, cache=self.cache, use_cache=True,
                           attention_mask=causal_row_mask(positions, longest, self.dtype),
                           output_hidden_states=self.hidden_ids or False)
        last = out.last_hidden_state[torch.arange(k, device=self.device), lengths - 1]  # [k, C]
        self._set_sampling(rows, batch)
        first = self._choose_first(self.lm_head(last)[:, None], rows, batch)  # [k]
        if self.hidden_ids:
            self.proposer.append_context(rows, self._context_features(out), zeros)
        self.lens[rows] = lengths
        self.anchor[rows] = first
        self.remaining[rows] = torch.tensor([r.max_new - 1 for r in batch], device=self.device)
        return first

    def _decode(self, events: list[StepEvent]):
        n, k = len(self.rows), self.num_draft_tokens
        rows = slice(0, n)
        lens, anchor = self.lens[rows], self.anchor[rows]
        if k:
            drafts = self.proposer.propose(rows, anchor, lens, [r.committed for r in self.rows],
                                           [r.request.request_id for r in self.rows])  # [n, K]
        else:
            drafts = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        verify_ids = torch.cat([anchor[:, None], drafts.to(self.device)], 1)  # [n, K+1]
        kv_len = max(r.committed for r in self.rows) + k  # (committed - 1) + (K + 1), host-known
        positions = write_index(lens, k + 1)            # [n, K+1]
        self.cache.prepare(rows, lens, k + 1, kv_len)
        out = self.decoder(input_ids=verify_ids, position_ids=positions, cache=self.cache, use_cache=True,
                           attention_mask=causal_row_mask(positions, kv_len, self.dtype),
                           output_hidden_states=self.hidden_ids or False)
        logits = self.lm_head(out.last_hidden_state)  # [n, K+1, V]
        limit = self.remaining[rows] - 1              # drafts that fit the row's budget beside the bonus
        accepted, tokens = greedy_accept(target_logits=logits, drafts=verify_ids[:, 1:], limit=limit)
        if any(not r.request.params.greedy for r in self.rows):
            probs = sampling_probs(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows],
                                   filtered=self._any_filtered())
            s_accepted, s_tokens = rejection_accept(target_probs=probs, drafts=verify_ids[:, 1:], limit=limit,
                                                    uniforms=self._uniforms(k + 1))
            sampled = self.temperature[rows] > 0
            accepted = torch.where(sampled, s_accepted, accepted)
            tokens = torch.where(sampled[:, None], s_tokens, tokens)
        if self.hidden_ids:
            self.proposer.append_context(rows, self._context_features(out), lens)
        self.lens[rows] += accepted + 1
        self.remaining[rows] -= accepted + 1
        self.anchor[rows] = tokens.gather(1, accepted[:, None])[:, 0]
        packed = torch.cat([accepted[:, None], tokens], 1).tolist()  # the step's one host sync
        now = time.perf_counter()
        for row, (a, *row_tokens) in zip(self.rows, packed):
            budget = row.max_new - len(row.tokens)
            self._commit(row, row_tokens[:a + 1], events, now, drafted=min(k, budget - 1))

    def _commit(self, row: _Row, new_tokens: list[int], events: list[StepEvent], now: float,
                drafted: int | None = None):
        """Append a step's tokens to a row on the host: stop tokens, budget, statistics."""
        cut = next((i + 1 for i, t in enumerate(new_tokens) if t in row.stop_ids), None)
        if cut is not None:
            new_tokens, row.finish_reason = new_tokens[:cut], "stop"
        if drafted is not None:  # decode step (not the prefill token)
            row.stats.observe_step(drafted, len(new_tokens) - 1)
        row.tokens.extend(new_tokens)
        if row.finish_reason is None and len(row.tokens) >= row.max_new:
            row.finish_reason = "length"
        events.append(StepEvent(row.request.request_id, new_tokens, None))
        if row.finish_reason is not None:
            events[-1].completion = self._completion(row, now)

    def _completion(self, row: _Row, now: float) -> Completion:
        return Completion(request_id=row.request.request_id, prompt_token_ids=row.request.prompt_token_ids,
                          token_ids=list(row.tokens), finish_reason=row.finish_reason, stats=row.stats,
                          time_to_first_token_s=(row.first_token_time or now) - row.arrival,
                          time_taken_s=now - row.arrival)

    def _evict(self, events: list[StepEvent]):
        """Free the slots of finished rows, moving the last active row into each hole."""
        for slot in reversed(range(len(self.rows))):
            row = self.rows[slot]
            if row.finish_reason is None:
                continue
            if row.finish_reason == "abort":
                events.append(StepEvent(row.request.request_id, [], self._completion(row, time.perf_counter())))
            last = len(self.rows) - 1
            if slot != last:
                self._move_row(last, slot)
            self.rows.pop()
            self._running_ids.discard(row.request.request_id)

    def _move_row(self, src: int, dst: int):
        length = self.rows[src].committed  # positions [0, committed - 1) are live; one more is harmless
        self.kv.move_row(src, dst, length)
        if self.proposer is not None:
            self.proposer.move_row(src, dst, length)
        for t in (self.lens, self.anchor, self.remaining, self.temperature, self.top_p, self.top_k):
            t[dst] = t[src]
        self.rows[dst] = self.rows[src]

    # ---- sampling helpers -------------------------------------------------------------------------

    def _set_sampling(self, rows: slice, batch: list[_Row]):
        p = [r.request.params for r in batch]
        self.temperature[rows] = torch.tensor([x.temperature for x in p], device=self.device)
        self.top_p[rows] = torch.tensor([x.top_p for x in p], device=self.device)
        self.top_k[rows] = torch.tensor([x.top_k for x in p], device=self.device)

    def _any_filtered(self) -> bool:
        return any(r.request.params.top_k > 0 or r.request.params.top_p < 1.0 for r in self.rows)

    def _uniforms(self, count: int, rows: list[_Row] | None = None) -> torch.Tensor:
        """`[n, count]` uniforms from each sampled row's own generator (zeros for greedy rows)."""
        rows = self.rows if rows is None else rows
        u = torch.stack([torch.rand(count, generator=r.generator, dtype=torch.float64) if r.generator is not None
                         else torch.zeros(count, dtype=torch.float64) for r in rows])
        return u.to(self.device)

    def _choose_first(self, logits: torch.Tensor, rows: slice, batch: list[_Row]) -> torch.Tensor:
        """First token per admitted row from the prompt's last logits `[k, 1, V]` -> `[k]`."""
        first = logits[:, 0].argmax(-1)
        if any(r.generator is not None for r in batch):
            probs = sampling_probs(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows],
                                   filtered=any(r.request.params.top_k > 0 or r.request.params.top_p < 1.0
                                                for r in batch))
            sampled = sample_from_probs(probs[:, 0], self._uniforms(1, batch)[:, 0])
            first = torch.where(self.temperature[rows] > 0, sampled, first)
        return first

    def _context_features(self, out) -> torch.Tensor:
        return torch.cat([out.hidden_states[i] for i in self.hidden_ids], -1)  # [n, q, F]


def _length_groups(rows: list[_Row], slack: float = 1.25) -> list[list[_Row]]:
    """Split rows sorted by prompt length so that padding stays within `slack` of the real tokens:
    ragged prompts prefill in a few forwards instead of one mostly padded one."""
    groups: list[list[_Row]] = []
    real = 0
    for row in rows:
        m = len(row.request.prompt_token_ids)
        if groups and (len(groups[-1]) + 1) * m <= slack * (real + m):
            groups[-1].append(row)
            real += m
        else:
            groups.append([row])
            real = m
    return groups


def _check_kv_fits(device: torch.device, rows: int, positions: int, bytes_per_position: int):
    """Fail with advice instead of an opaque out-of-memory error: KV buffers are static per row."""
    if device.type != "cuda":
        return
    need = rows * positions * bytes_per_position
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        raise ValueError(f"KV buffers for max_rows={rows} x max_model_len={positions} need {need / 2**30:.1f} GiB "
                         f"but {free / 2**30:.1f} GiB are free on {device}: lower max_model_len or max_batch_size")
