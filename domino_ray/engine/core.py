"""The batched speculative engine: ragged rows over a paged KV pool, continuous batching.

Token ids in, token ids out: no text, no IO, no Ray. Glossary (shape comments): n active rows (at most R slots),
r = the rows a step runs (n, or with CUDA graphs n padded up to a row bucket), q query positions, K draft tokens per
step, B draft block size (S <= B the slots a step runs), V vocabulary, C hidden size, F = len(target_layer_ids) * C.
Speculative-decoding words (draft tokens, accepted, bonus, step) are defined in `spec_decode/verify.py`.

A row's committed tokens are prompt + generated. Its last committed token, the *anchor*, has not been
through the target yet: the target KV holds positions `[0, lens)` with `lens = committed - 1`, and so
does the draft's context. One step (`SpecEngine.step`), its parts numbered at the lines that do them:
  1. schedule: the scheduler's `StepPlan` (`step_types.py`) names the prompt segments prefilled this step, within its
             token budget; rows whose prompt is then in join the active rows with their first token
  2. room:   the plan's decode part, made once they joined (a first token may finish its row): the rows preempted
             while the pool cannot hold every active row's next step, and the blocks the others take
  3. width:  the verify width W (0..K) for this step: K, or for an adaptive engine the width
             controller's choice from measured costs and acceptance estimates (`spec_decode/width_policy.py`)
  4. draft:  the proposer turns each anchor into W draft tokens (none when W = 0)      -> [n, W]
  5. verify: one target forward over `[anchor, d_1..d_W]` at positions `lens + 0..W`  -> [n, W+1, V]
  6. accept: `spec_decode/verify.py` picks a (accepted) and the bonus; `lens += a + 1`; the hidden states of the
     a + 1 newly committed positions become the draft's new context (an eager adaptive engine's W = 0
     steps defer that: `context_ring.py`). Rejected positions stay in the buffers beyond `lens` and are
     overwritten next step: nothing is cropped.
  7. one host sync: accepted counts and tokens, near-ties (and logprobs when a row asks): the runner's `StepOutput`
  8. update: `commit.update_from_output` cuts each row at its stop ids and stop strings and its length limit, and
     counts its statistics; finished rows leave.
Target-only decoding is the same loop with K = 0 (no proposer): the baseline.

Parts 4-6 are pure device work (`runner.py`) on fixed-address buffers with fixed shapes per *bucket*: with CUDA
graphs the active rows are padded to a row bucket (1, 2, 4, 8, ... up to R; eager steps run the active rows alone).
Padding slots are free slots with `remaining == 0`: they compute but never advance, write into the null block, and
the host never reads them. The KV is paged (`kv/pools.py`): a row holds blocks of `kv_block_size` positions,
taken as it grows from a pool sized in tokens (`kv_cache_tokens`), and attention reads each row's own blocks up to
its own length, so the step's shape does not depend on the rows' lengths. On CUDA parts 4-6 are one CUDA graph per
row bucket, width and sampling mode, every greedy one captured at engine start (`step_graphs.py`). On CPU the same
functions run eagerly.

Admission is by free blocks, prompts are prefilled in chunks within a per-step budget between decode steps, whole
prompt blocks are shared, and a row preempted when the pool runs out is prefilled again later from its prompt and
generated tokens, its output unchanged (`scheduler.py`).

Building an engine is staged too (`build.py`): patch the model, plan memory, allocate, capture, start-up costs.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable, Iterable

import torch

from domino_ray.engine.build import patch_model
from domino_ray.engine.commit import commit, update_from_output
from domino_ray.engine.constrained import constraint_mask, forced_tokens, forced_width, put_forced
from domino_ray.engine.context_ring import ContextRing
from domino_ray.kv.blocks import BlockPool
from domino_ray.engine.memory import engine_plan, fit_to_memory
from domino_ray.engine.request import Completion, Request, Row, StepEvent, new_row
from domino_ray.engine.runner import StepRunner
from domino_ray.engine.scheduler import Scheduler
from domino_ray.engine.start_up_costs import width_controller
from domino_ray.engine.step_graphs import StepGraphs, capture_steps, greedy_step_keys, row_buckets, use_cuda_graphs
from domino_ray.engine.step_types import PrefillSegment, StepOutput, StepPlan
from domino_ray.kv.pools import reads_in_place
from domino_ray.spec_decode.draft import DraftConfig
from domino_ray.sample.sampling import StepMode, sampling_mode
from domino_ray.spec_decode.width_costs import StepCosts, step_widths
from domino_ray.spec_decode.width_policy import WidthController

log = logging.getLogger(__name__)

GATHER_CHUNK = 256  # the gather path's key lengths are multiples of this (`_key_len`)


class SpecEngine:
    """Batched speculative (or, without a proposer, target-only) generation on one device.

    `max_rows`: rows decoded together at most (slots), or "auto": as many as `gpu_memory_utilization` of the memory
    free after the weights holds beside the KV pool (`memory.size_engine`); on CPU at most a default from the cores.
    `kv_block_size`: positions per KV block (a power of two; our CPU kernel wants a multiple of 8).
    `kv_cache_tokens`: the KV pool in tokens, or "auto": what the memory left after the rest of the plan holds (on CPU
    at most every row at `max_model_len`).
    `cuda_graphs`: "auto" (on for CUDA), "on" or "off".
    `adaptive`: pick the verify width 0..K every step (`spec_decode/width_policy.py`; the config's
    `num_draft_tokens: auto`, resolved by `draft.resolve_num_spec_tokens`); otherwise every step verifies K.
    `width_costs`: seconds per step by row bucket and verify width for the adaptive width, as
    `{bucket: {W: seconds}}` or a `StepCosts`; None = measure them now.
    `max_prefill_tokens`: prompt tokens prefilled per step at most (a longer prompt is prefilled in chunks,
    interleaved with decode steps).
    """

    def __init__(self, target, proposer=None, *, max_rows: int | str = 16, max_model_len: int | None = None,
                 eos_token_ids: Iterable[int] = (), seed: int = 0, max_prefill_tokens: int = 8192,
                 kv_block_size: int = 16, kv_cache_tokens: int | str = "auto", cuda_graphs: str = "auto",
                 adaptive: bool = False, width_costs: dict | StepCosts | None = None,
                 gpu_memory_utilization: float = 0.9):
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
        self.layers, self.precision, self.prefill_gemm_rows = patch_model(target, proposer)  # 1. patch the model
        # The step's shape, which the memory plan, the buffers and the graphs are sized by
        self.cuda_graphs = graphs = use_cuda_graphs(cuda_graphs, self.device)
        # A step writes up to `span` positions past a row's committed context (verify K+1, draft block B).
        self.span = max(k + 1, proposer.block_size if proposer is not None else 1)
        self.block_size = kv_block_size
        self.capacity = _round_up(self.max_model_len + self.span, kv_block_size)
        self.adaptive = adaptive and k > 0
        # Graphs need fixed shapes: a step's rows padded up to a row bucket. Eager steps run the active rows alone.
        self.pad_rows = graphs
        # W = 0 steps keep their taps and feed the draft's context in batches (`DEFERRED_STEPS`): eager steps only
        self.defer_context = self.adaptive and not graphs and bool(getattr(proposer, "target_layer_ids", ()))
        head_dims = [getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads]
        head_dims += [proposer.config.head_dim] if isinstance(getattr(proposer, "config", None), DraftConfig) else []
        # Whether a step gathers the rows' keys up to its key_len (`_key_len`) instead of reading them in place
        self.gathers = not all(reads_in_place(self.device, self.dtype, d, kv_block_size) for d in head_dims)
        self.max_rows, self.kv_blocks, self.slot_report = fit_to_memory(  # 2. plan memory
            self.device, gpu_memory_utilization, max_rows, kv_cache_tokens, self.memory_plan, kv_block_size,
            self.capacity)
        self._allocate(seed)  # 3. allocate
        self._capture(required=cuda_graphs == "on")  # 4. capture
        self.width: WidthController | None = width_controller(self, width_costs)  # 5. start-up costs; None: W = K

    def _allocate(self, seed: int):
        """The per-slot state, once: the block book and the queue (`scheduler.py`), the ring, the device buffers (the
        KV pools, the block tables, the proposer's state, row state, step outputs: `runner.py`), the step widths of
        each row bucket."""
        r = self.max_rows
        self.blocks = BlockPool(self.kv_blocks, self.block_size)
        self.scheduler = Scheduler(self.blocks, max_rows=r, span=self.span, max_prefill_tokens=self.max_prefill_tokens)
        self.pending = self.scheduler.pending  # waiting rows in order; those holding blocks are being prefilled
        self.ring = ContextRing(self.proposer, self.device, self.defer_context)  # the draft's context not fed yet
        self.runner = StepRunner(self.target, self.layers, self.proposer, self.ring, rows=r, capacity=self.capacity,
                                 blocks=self.kv_blocks, block_size=self.block_size)
        self.row_buckets = row_buckets(r)
        self.widths = step_widths(self.row_buckets, self.num_spec_tokens, self.adaptive, self.cuda_graphs)  # {r: [W]}
        self.rows: list[Row] = []      # active rows; rows[i] lives in slot i
        self._running_ids: set = set()  # request ids of pending and active rows
        self.rng = torch.Generator().manual_seed(seed)

    def _capture(self, required: bool):
        """With CUDA graphs, every greedy step key captured now, while every slot is free (padding rows: the steps
        leave them unchanged); `required`: a failed capture raises. Host-side proposers (tests) have no graphs."""
        self.graphs = StepGraphs(self.device, required=required) if self.cuda_graphs else None
        self.graph_capture_s = capture_steps(
            self.graphs, greedy_step_keys(self.row_buckets, self.widths),
            lambda key: self._device_step(key[1], self.capacity, *key[2:])) \
            if self.graphs is not None and not self.host_drafts else 0.0

    def memory_plan(self, rows: int | None = None, blocks: int | None = None) -> dict[str, int]:
        """Bytes beyond the weights with `rows` rows and `blocks` pool blocks (default: its own): `memory.memory_plan`."""
        return engine_plan(self, rows or self.max_rows, self.kv_blocks if blocks is None else blocks)

    def kv_cache_stats(self) -> dict[str, int]:
        """block_size, blocks, peak_blocks_used, peak_rows, preemptions, prefix_hit_tokens (`blocks.KVCacheStats`)."""
        return self.blocks.stats.to_dict()

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request):
        """Queue a request; raises ValueError (naming the field) for a request that cannot run."""
        if request.request_id in self._running_ids:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        row = new_row(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len, rng=self.rng,
                      eos_token_ids=self.eos_token_ids, num_spec_tokens=self.num_spec_tokens)
        self._running_ids.add(request.request_id)
        self.pending.append(row)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a pending request (and any blocks it holds) or end an active one at the next step."""
        for row in self.pending:
            if row.request.request_id == request_id:
                self.pending.remove(row)
                self._release(row)
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

    # ---- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One step, its parts numbered as in the module docstring: prefill pending prompts within the step's token
        budget (rows whose prompt is in join), make room for the active rows' next step, one speculative step for all
        active rows, its tokens committed."""
        events: list[StepEvent] = []
        self._evict(events)  # aborted rows free their slots first
        plan = self.scheduler.schedule(self.rows)  # 1. schedule: this step's prefill
        if plan.prefill:
            self._admit(plan.prefill, events)  # rows whose prompt is then in join, with their first token
            self._evict(events)  # rows their first token finished
        stats = self.blocks.stats  # counted before the decode, which may finish rows
        stats.peak_rows = max(stats.peak_rows, len(self.rows) + len(self.scheduler.holders()))
        if self.rows:
            plan = self.scheduler.make_room(plan, self.rows)  # 2. room: preemptions, the next step's blocks
            self._apply_plan(plan)
            output, now = self._decode()  # 3-7. width, draft, verify, accept, one host sync
            events += update_from_output(self.rows, output, now)  # 8. stop and length rules, statistics
            self._evict(events)
        return events

    def _admit(self, segments: list[PrefillSegment], events: list[StepEvent]):
        """Prefill `segments` in one forward (`StepPlan.prefill`); rows whose prompt is then in join the active rows
        (`_join`)."""
        ids = torch.tensor([t for segment in segments for t in segment.ids])[None]  # [1, N]
        tables = [torch.tensor(s.row.blocks, dtype=torch.int32)[None].to(self.device) for s in segments]  # [1, nb]
        hidden, taps = self.runner.prefill(ids, segments, tables)
        if taps is not None:
            self.ring.add_prompts([s.row for s in segments], tables, [s.start for s in segments], taps,
                                  [s.length for s in segments])
        done, ends = self.scheduler.finish_segments(segments)
        if done:
            self._join(events, done, hidden[0, ends])

    def _join(self, events: list[StepEvent], done: list[Row], last: torch.Tensor):
        """Rows whose prompt is in take the next slots: new rows sample their first token from their last position's
        hidden state (`last [k, C]`, in `done`'s order); preempted rows coming back resume from their last token."""
        self.ring.before_admission(len(self.rows), self.runner.lens, self.runner.block_tables)
        new = [i for i, row in enumerate(done) if not row.tokens]
        back = [i for i, row in enumerate(done) if row.tokens]
        order = [done[i] for i in new + back]  # slot order: the new rows' slots form one range for the sampling
        lo, f = len(self.rows), len(new)
        rows = slice(lo, lo + len(order))
        self.runner.set_tables(list(range(rows.start, rows.stop)), [row.blocks for row in order])
        mode = sampling_mode(row.request.params for row in order)
        self.runner.load_rows(rows, [row.request.params for row in order], [row.seed for row in order],
                              [row.stop_ids for row in order], [row.request.prompt_token_ids for row in order], mode,
                              [row.tokens for row in order] if back else None)
        if self.width is not None:
            for slot in range(rows.start, rows.stop):
                self.width.reset_slot(slot)
        first_tokens, logprobs = [], None
        if new:
            ints = torch.tensor([[len(done[i].request.prompt_token_ids), done[i].max_new - 1] for i in new])
            mask = (constraint_mask([done[i] for i in new], [[] for _ in new], f, self.vocab_size, self.device)
                    if mode.constrained else None)
            first, logprobs = self.runner.first_tokens(slice(lo, lo + f), last[new], ints.to(self.device), mode,
                                                       mask)
            first_tokens = first.tolist()  # host sync: the first tokens
            logprobs = [x.tolist() for x in logprobs] if logprobs is not None else None
        if back:
            self.runner.start(slice(lo + f, rows.stop), torch.tensor(
                [[len(row.context_ids()), row.tokens[-1], row.max_new - len(row.tokens)] for row in order[f:]]))
        now = time.perf_counter()
        for i, row in enumerate(order):
            self.rows.append(row)
            if i < f:
                row.first_token_time = now
                events.append(commit(row, [first_tokens[i]], now,
                                     logprobs=(logprobs[0][i], logprobs[1][i]) if logprobs else None))

    def _apply_plan(self, plan: StepPlan):
        """The engine's side of `plan`'s decode part (`Scheduler.make_room`): preempted active rows leave their slots
        (`_vacate`), preempted rows' prompt taps not fed yet are dropped (their blocks may go to another row), and the
        active rows' block tables gain the blocks granted."""
        for row in plan.preempt:
            slot = next((slot for slot, active in enumerate(self.rows) if active is row), None)
            if slot is not None:
                self._vacate(slot)
            self.ring.drop(row)
            log.debug("preempted request %r at %d tokens", row.request.request_id, row.committed)
        if plan.grants:
            slot_of = {id(row): slot for slot, row in enumerate(self.rows)}
            self.runner.add_blocks([slot_of[id(grant.row)] for grant in plan.grants], plan.grants)

    def _release(self, row: Row):
        self.ring.drop(row)  # its prompt's taps not fed yet: its blocks may go to another row
        self.scheduler.release(row)

    def _decode(self) -> tuple[StepOutput, float]:
        """Parts 3-7 of the step for the active rows: its outcome and the host's time at its sync."""
        n = len(self.rows)
        r = next(b for b in self.row_buckets if b >= n) if self.pad_rows else n
        mode = sampling_mode(row.request.params for row in self.rows)
        w, context, t = self.num_spec_tokens, True, 0  # 3. width
        held = self.width.held(r, n) if self.width is not None else None  # W = 0 standing: (its look's t, context)
        if held is not None:
            w, (t, context) = 0, held
        elif self.width is not None:
            t = self._mean_keys(r)  # the mean key length at the widest step: the cost table's t
            w, context = self.width.choose(r, t, self._usable())
        forced = forced_tokens(self.rows) if mode.constrained else []  # drafts a grammar gives, where they pay
        wide = forced_width(forced, w, self.num_spec_tokens, self.width.costs.at(r, t or self._mean_keys(r))
                            if self.width is not None and forced else None)
        widened, w, context = wide > w, wide, True if wide > w else context
        # A W = 0 step writes one position (the anchor's), a drafting step up to `span` (draft block, verify)
        key_len = self._key_len(self.span if w else 1) if self.gathers and not self.cuda_graphs else self.capacity
        usable = self._usable() if w else [0] * n
        started = time.perf_counter()
        self.ring.before_step(w, context, n, self.runner.lens, self.runner.block_tables)  # timed with the step
        timed = self._device_step(r, key_len, w, mode, context, forced)  # 4-6. draft, verify, accept
        output = self.runner.read_output(n, w, mode.logprobs, [len(f[:w]) for f in forced])  # 7. one host sync
        now = time.perf_counter()
        # A step that captured a graph says nothing about its width's cost; one widened for forced tokens nothing
        # about the draft's acceptance
        if self.width is not None and not widened:
            self.width.learn(r, t, w, now - started if timed else None, output.accepted if w else (), usable)
        return output, now

    def _mean_keys(self, r: int) -> int:
        """The mean keys a row of a step over `r` slots attends at its widest (padding slots: `span`)."""
        return (sum(row.committed - 1 for row in self.rows) + r * self.span) // r

    def _key_len(self, span: int) -> int:
        """Keys the gather path reads for a step writing `span` positions past `committed - 1`: the longest row's,
        rounded up to `GATHER_CHUNK` (few distinct shapes: a compiled step is not specialized on every length). The
        kernels read each row's own: their steps pass the capacity, a constant."""
        longest = max(row.committed - 1 for row in self.rows) + span
        return min(_round_up(longest, max(GATHER_CHUNK, self.block_size)), self.capacity)

    def _usable(self) -> list[int]:
        """Drafts each active row's budget allows, in slot order (`Row.draft_budget`)."""
        return [row.draft_budget for row in self.rows]

    def _device_step(self, r: int, key_len: int, w: int, mode: StepMode, context: bool | None,
                     forced: list[list[int]] = ()) -> bool:
        """Draft `w` tokens (none when 0), then verify and accept them as `mode` asks, for slots `0..r` (their keys
        below `key_len`, `kv_cache.StepKeys`): one CUDA graph with graphs, whatever the rows' lengths. False when that
        graph was captured now (the step's time is not a step's cost). A constrained step runs eagerly: between the
        draft and the verify the host puts each row's `forced` tokens first among its drafts and builds the masks."""
        def step():
            if w and not self.host_drafts:
                self.runner.draft(r, key_len, w)
            mask = None
            if mode.constrained:  # host sync: the drafts, for the masks
                mask = constraint_mask(self.rows, put_forced(self.runner.drafts, forced, w), r, self.vocab_size,
                                       self.device)
            self.runner.verify(r, key_len, w, mode, context, mask)

        if w and self.host_drafts:  # test proposers: drafts from the rows' ids, so the whole step runs eagerly
            self.runner.draft(r, key_len, w, [row.committed for row in self.rows],
                              [row.request.request_id for row in self.rows])
        if self.graphs is None or self.host_drafts or mode.constrained:
            step()
            return True
        return self.graphs.run(("step", r, w, mode, context), step)

    # ---- host bookkeeping -------------------------------------------------------------------------

    def _evict(self, events: list[StepEvent]):
        """Free the slots and blocks of finished rows, moving the last active row into each hole."""
        for slot in reversed(range(len(self.rows))):
            row = self.rows[slot]
            if row.finish_reason is None:
                continue
            if row.finish_reason == "abort":
                events.append(StepEvent(row.request.request_id, [], row.completion(time.perf_counter())))
            self._vacate(slot)
            self._release(row)
            self._running_ids.discard(row.request.request_id)

    def _vacate(self, slot: int):
        """The row in `slot` leaves the active rows; the last one moves into its slot (its state and block table: the
        keys stay where they are)."""
        last = len(self.rows) - 1
        if slot != last:
            self.runner.move_slots(last, slot)
            self.ring.move(last, slot)
            if self.width is not None:
                self.width.move_slots([last], [slot])
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        self.runner.free_slot(last)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
