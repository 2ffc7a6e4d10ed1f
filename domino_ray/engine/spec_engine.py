"""The batched speculative engine: ragged rows, per-row KV offsets, continuous batching.

Token ids in, token ids out: no text, no IO, no Ray. One engine serves a list of requests with a fixed
number of slots; a finished row frees its slot and the next pending request is prefilled into it.

Glossary (shape comments): n active rows (at most R slots), r = the rows a step runs (n, or with CUDA
graphs n padded up to a row bucket), q query positions, T buffer positions (the key bucket), K draft
tokens per step, B draft block size (S <= B the slots a step runs), V vocabulary, C hidden size,
F = len(target_layer_ids) * C.
Speculative-decoding words (draft tokens, accepted, bonus, step) are defined in `spec/verify.py`.

A row's committed tokens are prompt + generated. Its last committed token, the *anchor*, has not been
through the target yet: the target KV holds positions `[0, lens)` with `lens = committed - 1`, and so
does the draft's context. One step, for all active rows at once:
  0. width:  the verify width W (0..K) for this step: K, or for an adaptive engine the width
             controller's choice from measured costs and acceptance estimates (`spec/width_policy.py`)
  1. draft:  the proposer turns each anchor into W draft tokens (none when W = 0)      -> [n, W]
  2. verify: one target forward over `[anchor, d_1..d_W]` at positions `lens + 0..W`  -> [n, W+1, V]
  3. accept: `spec/verify.py` picks a (accepted) and the bonus; `lens += a + 1`; the hidden states of the
     a + 1 newly committed positions become the draft's new context (an eager adaptive engine's W = 0
     steps defer that: `context_ring.py`). Rejected positions stay in the buffers beyond `lens` and are
     overwritten next step: nothing is cropped.
  4. one host sync: accepted counts and tokens (and logprobs when a row asks); stop checks (stop ids, stop
     strings), statistics, finished rows leave.
Target-only decoding is the same loop with K = 0 (no proposer): the baseline.

Steps 1-3 are pure device work (`runner.py`) on fixed-address buffers with fixed shapes per *bucket*: the
attended keys are padded to a key bucket (a multiple of `kv_chunk`; `step_graphs.key_buckets`) and, with CUDA
graphs, the active rows to a row bucket (1, 2, 4, 8, ... up to R; eager steps run the active rows alone).
Padding slots are free slots with `remaining == 0`: they compute but never advance, and the host never
reads them. The slots are cut into a few contiguous ranges, each attending over its own
key bucket, so a row's attention reads about what the row holds (`model/key_groups.py`; the slots are kept
longest first for that, moving rows when it pays). On CUDA steps 1-3 are one CUDA graph per bucket and
width, every greedy one captured at engine start (`step_graphs.py`); with graphs the slots form one range
over the longest row's bucket (the graph keys stay one per (r, t)). On CPU the same functions run eagerly.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate
from typing import Callable, Hashable, Iterable

import torch

from domino_ray.backend.malloc import keep_freed_memory
from domino_ray.engine.context_ring import DEFERRED_STEPS, ContextRing
from domino_ray.engine.memory import auto_slots, check_memory_fits, free_device_memory, memory_plan
from domino_ray.engine.request import Completion, Request, Row, StepEvent, check_prompt
from domino_ray.engine.runner import StepRunner
from domino_ray.engine.step_graphs import (StepGraphs, capture_steps, greedy_step_keys, key_buckets, row_buckets,
                                           use_cuda_graphs, verify_positions)
from domino_ray.model.fused_layers import fuse_layers
from domino_ray.model.key_groups import GROUP_COST, Groups, KeyReads, plan as plan_key_groups
from domino_ray.model.packed_linear import pack_linears
from domino_ray.model.target_forward import install
from domino_ray.spec.sampling import GREEDY, StepMode, sampling_mode
from domino_ray.spec.stats import RowStats
from domino_ray.spec.width_costs import StepCosts, measure_step_costs, step_widths
from domino_ray.spec.width_policy import WidthController

log = logging.getLogger(__name__)


class SpecEngine:
    """Batched speculative (or, without a proposer, target-only) generation on one device.

    `kv_chunk`: the key buckets (the attended key lengths, `step_graphs.key_buckets`) are multiples of it:
    every multiple eagerly (default 32: little attention over padding), doubling from 512 with CUDA graphs
    (default 256; few buckets, so few graphs).
    `max_key_groups`: slot ranges a decode step's attention is cut into, each over its own key bucket
    (`model/key_groups.py`); default 4, and 1 with CUDA graphs (a graph per group structure would be unbounded).
    `max_rows`: slots (rows decoded together), or "auto": as many as `gpu_memory_utilization` of the device
    memory free after the weights holds (`memory.plan_slots`); on CPU a default from the cores and host memory.
    `cuda_graphs`: "auto" (on for CUDA), "on" or "off".
    `adaptive`: pick the verify width 0..K every step (`spec/width_policy.py`; the config's
    `num_draft_tokens: auto`, resolved by `draft.resolve_num_spec_tokens`); otherwise every step verifies K.
    `width_costs`: seconds per step by row bucket and verify width for the adaptive width, as
    `{bucket: {W: seconds}}` or a `StepCosts`; None = measure them now.
    """

    def __init__(self, target, proposer=None, *, max_rows: int | str = 16, max_model_len: int | None = None,
                 eos_token_ids: Iterable[int] = (), seed: int = 0, max_prefill_tokens: int = 8192,
                 kv_chunk: int | None = None, cuda_graphs: str = "auto", adaptive: bool = False,
                 width_costs: dict | StepCosts | None = None, gpu_memory_utilization: float = 0.9,
                 max_key_groups: int | None = None):
        cfg = target.config
        self.target, self.decoder, self.lm_head = target, target.get_decoder(), target.get_output_embeddings()
        self.proposer = proposer
        self.host_drafts = proposer is not None and not getattr(proposer, "graph_safe", False)  # test proposers
        k = self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0  # K, per step at most
        limits = [x for x in (max_model_len, getattr(cfg, "max_position_embeddings", None)) if x]
        if not limits:
            raise ValueError("max_model_len is required: the target config has no max_position_embeddings")
        self.max_model_len = min(limits)
        self.vocab_size = cfg.vocab_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        weight = next(target.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        install(target)
        if self.device.type == "cpu":
            keep_freed_memory()  # the forwards' large activations reuse freed memory: `backend/malloc.py`
        self.layers = fuse_layers(self.decoder)  # the Llama family's layers over fused projections
        pack_linears(self.layers, self.lm_head, getattr(proposer, "draft", None))  # CPU, fp32: `packed_linear.py`
        graphs = use_cuda_graphs(cuda_graphs, self.device)
        # A step writes up to `span` positions past a row's committed context (verify K+1, draft block B).
        self.span = max(k + 1, proposer.block_size if proposer is not None else 1)
        self.kv_chunk = kv_chunk or (256 if graphs else 32)
        self.capacity = _round_up(self.max_model_len + self.span, self.kv_chunk)
        self.key_buckets = key_buckets(self.capacity, self.kv_chunk, graphs)
        self.adaptive = adaptive and k > 0
        self.cuda_graphs = graphs
        # Graphs need fixed shapes: a step's rows padded up to a row bucket. Eager steps run the active rows alone.
        self.pad_rows = graphs
        # W = 0 steps keep their taps and feed the draft's context in batches (`DEFERRED_STEPS`): eager steps only
        self.defer_context = self.adaptive and not graphs and bool(getattr(proposer, "target_layer_ids", ()))
        self.max_key_groups = max_key_groups or (1 if graphs else 4)
        if graphs and self.max_key_groups != 1:
            raise ValueError(f"max_key_groups={max_key_groups} needs eager steps (cuda_graphs=off): a graph per "
                             "group structure would make the graph keys unbounded")
        self.key_reads = KeyReads()  # keys read per layer by decode steps (the step's key groups)
        self.group_cost = GROUP_COST["cpu" if self.device.type == "cpu" else "cuda"]
        self.slot_report: str | None = None  # how `max_rows="auto"` chose, for the edge to show
        if max_rows == "auto":
            max_rows, self.slot_report = auto_slots(self.device, gpu_memory_utilization, self.memory_plan)
        self.max_rows = max_rows
        if self.device.type == "cuda":  # before allocating anything
            check_memory_fits(self.memory_plan(), free_device_memory(self.device), self.device, gpu_memory_utilization)
        self._allocate(max_rows, k)
        self.rows: list[Row] = []      # active rows; rows[i] lives in slot i
        self.pending: deque[Row] = deque()
        self._running_ids: set = set()  # request ids of pending and active rows
        self.rng = torch.Generator().manual_seed(seed)
        self.graphs = StepGraphs(self.device, required=cuda_graphs == "on") if graphs else None
        # Every greedy step key captured now, while every slot is free (padding rows: the steps leave them
        # unchanged). Host-side proposers (tests) have no graphs.
        self.graph_capture_s = capture_steps(
            self.graphs, greedy_step_keys(self.row_buckets, self.key_buckets, self.widths),
            lambda key: self._device_step(*key[1:])) if graphs and not self.host_drafts else 0.0
        self.width: WidthController | None = None  # None: every step verifies K
        if self.adaptive:
            costs = (width_costs if isinstance(width_costs, StepCosts) else StepCosts(width_costs) if width_costs
                     else self.measure_costs(self.widths))
            self.width = WidthController(k, max_rows, costs, lazy_context=self.defer_context)

    def _allocate(self, r: int, k: int):
        """The per-slot state, once: the ring, the device buffers (target KV, the proposer's state, row state, step
        outputs: `runner.py`), the step widths of each row bucket."""
        self.ring = ContextRing(self.proposer, self.device, self.defer_context)  # the draft's context not fed yet
        self.runner = StepRunner(self.target, self.layers, self.proposer, self.ring, rows=r, capacity=self.capacity)
        self.row_buckets = row_buckets(r)
        self.widths = step_widths(self.row_buckets, k, self.adaptive, self.cuda_graphs)  # {r: [W, ...]}

    def memory_plan(self, rows: int | None = None) -> dict[str, int]:
        """Bytes beyond the weights for this engine's sizes with `rows` slots (default: its own), `memory.memory_plan`."""
        rows = rows or self.max_rows
        return memory_plan(self.target.config, getattr(self.proposer, "config", None),
                           max_rows=rows, num_spec_tokens=self.num_spec_tokens,
                           capacity=self.capacity, max_prefill_tokens=self.max_prefill_tokens,
                           itemsize=self.dtype.itemsize, cuda_graphs=self.cuda_graphs,
                           verify_positions=verify_positions(rows, self.num_spec_tokens, self.adaptive, self.cuda_graphs),
                           deferred_positions=DEFERRED_STEPS if self.defer_context else 0)

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request):
        """Queue a request; raises ValueError (naming the field) for a request that cannot run."""
        ids, params = request.prompt_token_ids, request.params
        check_prompt(ids, self.vocab_size, self.max_model_len)
        if request.request_id in self._running_ids:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params.validate()
        if params.n != 1:
            raise ValueError(f"n={params.n}: the engine runs one sample per request; expand n at the edge "
                             "(SamplingParams.for_sample)")
        seed = 0
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.rng))
        stop = params.stop_ids(self.eos_token_ids)
        if params.stop and request.stop_strings is None:
            raise ValueError("params.stop needs a stop matcher: Request(stop_strings=StopStrings(tokenizer, stop))")
        self._running_ids.add(request.request_id)
        self.pending.append(Row(request=Request(request.request_id, list(ids), params, request.stop_strings),
                                max_new=min(params.max_new_tokens, self.max_model_len - len(ids)),
                                stop_ids=frozenset(stop), seed=int(seed),
                                stats=RowStats(self.num_spec_tokens), arrival=time.perf_counter()))

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
        batch, tokens = [], 0
        while self.pending and len(self.rows) + len(batch) < self.max_rows:
            m = len(self.pending[0].request.prompt_token_ids)
            if batch and tokens + m > self.max_prefill_tokens:
                break
            batch.append(self.pending.popleft())
            tokens += m
        if not batch:
            return
        self.ring.before_admission(len(self.rows), self.runner.lens)
        lo = len(self.rows)
        first, logprobs = self._prefill(batch, slice(lo, lo + len(batch)))
        first_tokens = first.tolist()  # host sync: the first tokens
        logprobs = [x.tolist() for x in logprobs] if logprobs is not None else None
        now = time.perf_counter()
        for i, (row, token) in enumerate(zip(batch, first_tokens)):
            row.first_token_time = now
            self.rows.append(row)
            events.append(row.commit([token], now, logprobs=(logprobs[0][i], logprobs[1][i]) if logprobs else None))

    def _prefill(self, batch: list[Row], rows: slice) -> tuple[torch.Tensor, tuple | None]:
        """One target forward over the prompts back to back (no padding: every token is a prompt's) into slots
        `rows`; returns first tokens `[k]` and, when a row asks, their logprobs (`runner.prefill`)."""
        sizes = [len(r.request.prompt_token_ids) for r in batch]
        ids = torch.tensor([t for r in batch for t in r.request.prompt_token_ids])[None]   # [1, N]
        ints = torch.tensor([[m, r.max_new - 1, end - 1] for m, r, end in zip(sizes, batch, accumulate(sizes))])
        if self.width is not None:
            for slot in range(rows.start, rows.stop):
                self.width.reset_slot(slot)
        first, taps, logprobs = self.runner.prefill(
            ids, sizes, rows, ints.to(self.device), [r.request.params for r in batch], [r.seed for r in batch],
            [r.stop_ids for r in batch], sampling_mode(r.request.params for r in batch))
        if taps is not None:
            self.ring.add_prompts(rows, taps, sizes)
        return first, logprobs

    def _decode(self, events: list[StepEvent]):
        n = len(self.rows)
        r = next(b for b in self.row_buckets if b >= n) if self.pad_rows else n
        mode = sampling_mode(row.request.params for row in self.rows)
        w, context, t = self.num_spec_tokens, True, 0
        held = self.width.held(r, n) if self.width is not None else None  # W = 0 standing: (its look's t, context)
        if held is not None:
            w, (t, context) = 0, held
        elif self.width is not None:
            t = sum(self._slot_buckets(r, self.span)) // r  # the mean key bucket at the widest step: the cost table's t
            w, context = self.width.choose(r, t, self._usable())
        # A W = 0 step writes one position (the anchor's), a drafting step up to `span` (draft block, verify)
        key_groups = self._key_groups(r, self.span if w else 1)  # may move rows between slots first
        usable = self._usable() if w else [0] * n  # in the slots' order after any move (the width was chosen before)
        started = time.perf_counter()
        self.ring.before_step(w, context, n, self.runner.lens)  # timed with the step that needs it
        timed = self._device_step(r, key_groups, w, mode, context)
        packed, lp_values, lp_ids = self.runner.read_packed(n, w, mode.logprobs)  # the step's one host sync
        now = time.perf_counter()
        if self.width is not None:  # a step that captured a graph says nothing about its width's cost
            self.width.learn(r, t, w, now - started if timed else None, [a for a, *_ in packed] if w else (), usable)
        for i, (row, (a, *row_tokens), u) in enumerate(zip(self.rows, packed, usable)):
            events.append(row.commit(row_tokens[:a + 1], now, drafted=min(w, u), width=w,
                                     logprobs=(lp_values[i], lp_ids[i]) if lp_values is not None else None))

    def _key_groups(self, r: int, span: int) -> Groups:
        """The step's key groups for slots `0..r` (`key_groups.plan`), after moving the rows it says to move.
        `span`: positions the step writes past `committed - 1` (the KV's length); padding slots from 0.
        Host-side, from the rows' committed lengths: no device sync."""
        buckets = self._slot_buckets(r, span)
        key_groups, src, dst = plan_key_groups(buckets, len(self.rows), self.max_key_groups, self.group_cost)
        self._move_rows(src, dst)
        self.key_reads.observe(key_groups, sum(row.committed - 1 + span for row in self.rows), max(buckets), len(src))
        return key_groups

    def _slot_buckets(self, r: int, span: int) -> list[int]:
        """The key bucket of each of slots `0..r` for a step writing `span` positions past `committed - 1`
        (padding slots from 0)."""
        buckets = [self._key_bucket(row.committed - 1 + span) for row in self.rows]
        return buckets + [self._key_bucket(span)] * (r - len(self.rows))

    def _usable(self) -> list[int]:
        """Drafts each active row's budget allows, in slot order (the bonus token always comes)."""
        return [row.max_new - len(row.tokens) - 1 for row in self.rows]

    def _key_bucket(self, length: int) -> int:
        """The shortest key bucket holding `length` positions."""
        return self.key_buckets[bisect_left(self.key_buckets, min(length, self.capacity))]

    def _device_step(self, r: int, key_groups: Groups, w: int, mode: StepMode, context: bool | None) -> bool:
        """Draft `w` tokens (none when 0), then verify and accept them as `mode` asks, for slots `0..r` over
        `key_groups`: one CUDA graph with graphs. False when that graph was captured now (the step's time is not a
        step's cost)."""
        def step():
            if w and not self.host_drafts:
                self.runner.draft(r, key_groups, w)
            self.runner.verify(r, key_groups, w, mode, context)

        if w and self.host_drafts:  # test proposers: drafts from the rows' ids, so the whole step runs eagerly
            self.runner.draft(r, key_groups, w, [row.committed for row in self.rows],
                              [row.request.request_id for row in self.rows])
        if self.graphs is None or self.host_drafts:
            step()
            return True
        return self.graphs.run(("step", r, key_groups, w, mode, context), step)

    @torch.inference_mode()
    def measure_costs(self, widths: dict[int, list[int]], repeats: int = 3) -> StepCosts:
        """Step costs for the adaptive width, timed on `_device_step` (what real steps run) while every slot is
        free: padding rows, which the steps leave unchanged. Their lengths are set to fill the key bucket timed,
        since attention reads only the keys a row holds (the CPU kernel's key limits), then set back to 0."""
        def run_step(r: int, t: int, w: int):
            self.runner.lens[:r] = t - self.span  # a step writes `span` positions past a row's length
            self._device_step(r, ((r, t),), w, GREEDY, True)
            self.runner.read_packed(0, w)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        lengths = (self._key_bucket(self.span), self.capacity)
        try:
            return measure_step_costs(run_step, widths, lengths, repeats)
        finally:
            self.runner.lens.zero_()  # free slots are inert padding rows

    # ---- host bookkeeping -------------------------------------------------------------------------

    def _evict(self, events: list[StepEvent]):
        """Free the slots of finished rows, moving the last active row into each hole."""
        for slot in reversed(range(len(self.rows))):
            row = self.rows[slot]
            if row.finish_reason is None:
                continue
            if row.finish_reason == "abort":
                events.append(StepEvent(row.request.request_id, [], row.completion(time.perf_counter())))
            self.ring.drop(slot)
            last = len(self.rows) - 1
            if slot != last:
                self._move_rows([last], [slot])
            self.rows.pop()
            self.runner.free_slot(last)
            self._running_ids.discard(row.request.request_id)

    def _move_rows(self, src: list[int], dst: list[int]):
        """Row in slot `src[i]` -> slot `dst[i]`, everything a slot holds (the pairs may form cycles)."""
        if not src:
            return
        length = max(self.rows[s].committed for s in src)  # positions [0, committed - 1) are live; one more is harmless
        if len(src) == 1:  # ints: plain copies between two slots
            src_index, dst_index = src[0], dst[0]
        else:  # index tensors, copied once without a sync (a list index is copied, synchronously, at every use)
            pairs = torch.tensor([src, dst], pin_memory=self.device.type == "cuda")
            src_index, dst_index = pairs.to(self.device, non_blocking=True)
        self.runner.move_slots(src_index, dst_index, length)
        self.ring.move(src, dst, src_index, dst_index)
        if self.width is not None:
            self.width.move_slots(src, dst)
        moved = [self.rows[s] for s in src]
        for d, row in zip(dst, moved):
            self.rows[d] = row


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
