"""The device side of the engine: the per-slot buffers at fixed addresses and the work on them.

`StepRunner` holds the target's KV pool, each slot's row state (`lens`, `anchor`, `remaining`, its block table, its
sampling parameters) and a step's outputs, and runs the target forwards over them: a prefill of prompt segments into
the pool, and the fixed-shape step over slots `0..r` (draft W tokens, verify them, accept, advance the rows). The step
is pure device work (no host sync, no shape that varies with the rows' lengths: they are read from `lens` and the block
tables), so on CUDA each step key is one graph (`step_graphs.py`); the host reads its outcome once, through
`read_output` (a `StepOutput`). Which rows sit in which slot, which blocks they hold, and when a step runs at which
width, is the engine's (`core.py`).
"""

from __future__ import annotations

import torch

from domino_ray.backend import paged_triton
from domino_ray.engine.context_ring import ContextRing
from domino_ray.engine.step_graphs import row_buckets
from domino_ray.engine.step_types import BlockGrant, PrefillSegment, StepOutput
from domino_ray.kv.pools import KVPool, StepKeys, query_limits
from domino_ray.target.packed_linear import kv_dtype
from domino_ray.target.prefill_gemm import prefill_gemms
from domino_ray.target.forward import RowAttention, rotary_table, run_decoder
from domino_ray.sample.sampling import ConstraintMask, RowSampling, StepMode, token_logprobs
from domino_ray.sample.params import MAX_LOGPROBS


class StepRunner:
    """`rows` slots of up to `capacity` positions (a multiple of `block_size`) over a pool of `blocks` blocks, for
    `target` (its `layers` as the engine runs them, `fused_layers`) and `proposer` (None: target only; its pool, the
    same blocks, allocated here too); W = 0 steps' taps wait in `ring`."""

    def __init__(self, target, layers, proposer, ring: ContextRing, *, rows: int, capacity: int, blocks: int,
                 block_size: int):
        cfg = target.config
        self.decoder, self.lm_head, self.layers = target.get_decoder(), target.get_output_embeddings(), layers
        self.proposer, self.ring = proposer, ring
        weight = next(target.parameters())
        self.device = dev = weight.device
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k = proposer.num_spec_tokens if proposer is not None else 0
        r = rows
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv = KVPool(cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, head_dim, weight.dtype,
                         dev, kv_dtype(target))
        self.capacity = capacity
        self.tap_layers: tuple[int, ...] = ()
        if proposer is not None:  # its target_layer_ids are in range: `checkpoint.check_against_target`
            proposer.allocate(blocks, block_size, capacity)
            self.tap_layers = tuple(proposer.target_layer_ids)
        # [R, nb] each slot's blocks; a free slot's (a padding row's) are all the null block
        self.block_tables = torch.zeros(r, capacity // block_size, dtype=torch.int32, device=dev)
        # Row bucket -> the Triton kernel's split over the keys (`StepKeys`): few rows split theirs to fill the GPU
        self.splits: dict[int, int] = {}
        if self.kv.triton:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            self.splits = {b: paged_triton.choose_splits(b, self.kv.num_kv_heads, sms) for b in row_buckets(r)}
        self.lens = torch.zeros(r, dtype=torch.long, device=dev)       # [R] committed positions in the KV
        self.anchor = torch.zeros(r, dtype=torch.long, device=dev)     # [R] last committed token
        self.remaining = torch.zeros(r, dtype=torch.long, device=dev)  # [R] tokens the row may still emit; 0 = free
        self.sampling = RowSampling(r, cfg.vocab_size, dev, weight.dtype)
        self.drafts = torch.zeros(r, k, dtype=torch.long, device=dev)  # [R, K] the draft step's output
        # [R, 1 + K+1 + 1] accepted, tokens, near-ties (bit masks over the tokens; 0 unless counted)
        self.packed = torch.zeros(r, k + 3, dtype=torch.long, device=dev)
        pinned = dev.type == "cuda"
        self.packed_host = torch.zeros(r, k + 3, dtype=torch.long, pin_memory=pinned)
        # Each verified position's logprobs when a row asks: the token's then the top N's, and the top N's ids.
        lp_dtype, lp_shape = self.sampling.penalties.dtype, (r, k + 1, 1 + MAX_LOGPROBS)
        self.logprobs = torch.zeros(lp_shape, dtype=lp_dtype, device=dev)                    # [R, K+1, 1+N]
        self.logprob_ids = torch.zeros(r, k + 1, MAX_LOGPROBS, dtype=torch.long, device=dev)  # [R, K+1, N]
        self.logprobs_host = torch.zeros(lp_shape, dtype=lp_dtype, pin_memory=pinned)
        self.logprob_ids_host = torch.zeros(r, k + 1, MAX_LOGPROBS, dtype=torch.long, pin_memory=pinned)
        self.verify_offsets = torch.arange(k + 1, device=dev)        # [K+1]
        self.key_positions = torch.arange(capacity, device=dev)       # [T]
        self.cos_sin = rotary_table(self.decoder, capacity, weight.dtype)  # ([T, D], [T, D]) or None

    def prefill(self, ids: torch.Tensor, segments: list[PrefillSegment], tables: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over prompt `segments` (`ids [1, N]`, their tokens laid back to back, no padding): each
        writes its tokens at positions `start..` of its row (the earlier ones already in the pool), whose blocks are
        `tables[i] [1, nb]` (int32, on the device). Returns the normed hidden states `[1, N, C]` and the taps
        `[1, N, F]` (None without tap layers)."""
        bs = self.kv.block_size
        token_blocks = [s.row.blocks[p // bs] for s in segments for p in range(s.start, s.start + s.length)]
        positions = torch.cat([self.key_positions[s.start:s.start + s.length] for s in segments])[None]  # [1, N]
        where = torch.tensor(token_blocks, dtype=torch.long).to(self.device)                              # [N]
        attention = RowAttention(self.kv, self.kv.flat_index_of(where, positions[0] % bs),
                                 prefill_lengths=tuple(s.length for s in segments),
                                 prefill_offsets=tuple(s.start for s in segments), prefill_tables=tuple(tables))
        with prefill_gemms():  # oneDNN's bf16 GEMM where this CPU has it and it measured faster (`prefill_gemm.py`)
            return run_decoder(self.decoder, self.layers, ids.to(self.device), positions, attention, self.tap_layers,
                               cos_sin=self.cos_sin)

    def load_rows(self, rows: slice, params: list, seeds: list, stop_ids: list, prompts: list[list[int]],
                  mode: StepMode, generated: list[list[int]] | None = None):
        """Rows joining slots `rows`: their sampling `params`, `seeds`, `stop_ids` (for min_tokens) and penalty state
        from their `prompts` and, for preempted rows coming back, the tokens they had `generated`."""
        self.sampling.load(rows, params, seeds)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long).to(self.device)  # [N]
        self.sampling.penalties.load(rows, params, stop_ids, ids, [len(p) for p in prompts], mode.penalized)
        if mode.penalized and generated:
            self.sampling.penalties.restore(rows, generated)

    def first_tokens(self, rows: slice, last: torch.Tensor, ints: torch.Tensor, mode: StepMode,
                     mask: ConstraintMask | None = None) -> tuple[torch.Tensor, tuple | None]:
        """The first token of each prompt prefilled into slots `rows` from its last position's hidden state `last
        [k, C]`, the rows loaded (`load_rows`); `ints [k, 2]`: each prompt's length and the tokens it may emit after
        the first; `mask` the constrained rows' (`RowSampling.accept`). Returns the first
        tokens `[k]` and, when `mode.logprobs` is set, their logprobs (`token_logprobs`' pair at one position)."""
        lengths = ints[:, 0]
        # The first token is an acceptance step with zero drafts at the prompt's last position.
        no_drafts = torch.zeros(len(lengths), 0, dtype=torch.long, device=self.device)
        logits = self.lm_head(last)[:, None]  # [k, 1, V]
        zero = torch.zeros_like(lengths)
        _, first, _ = self.sampling.accept(rows, logits, no_drafts, zero, (lengths - 1)[:, None], mode, mask)
        if mode.penalized:  # the first token is a generated one
            self.sampling.penalties.commit(rows, first, zero, torch.ones_like(lengths, dtype=torch.bool))
        logprobs = token_logprobs(logits, first, mode.logprobs) if mode.logprobs is not None else None
        first = first[:, 0]  # [k]
        self.start(rows, torch.stack([lengths, first, ints[:, 1]], 1))
        return first, logprobs

    def start(self, rows: slice, state: torch.Tensor):
        """Slots `rows` decode from `state [k, 3]`: KV length, anchor, tokens the row may still emit."""
        self.lens[rows], self.anchor[rows], self.remaining[rows] = state.to(self.device).unbind(1)

    def set_tables(self, slots: list[int], blocks: list[list[int]]):
        """Slot `slots[i]` reads blocks `blocks[i]` (the rest of its table: the null block)."""
        table = torch.zeros(len(slots), self.block_tables.shape[1], dtype=torch.int32)
        for i, b in enumerate(blocks):
            table[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
        self.block_tables[torch.tensor(slots, device=self.device)] = table.to(self.device)

    def add_blocks(self, slots: list[int], grants: list[BlockGrant]):
        """Slot `slots[i]`'s table gains the blocks of `grants[i]` (rows growing into new blocks)."""
        entries = [(slot, g.index + j, block) for slot, g in zip(slots, grants) for j, block in enumerate(g.blocks)]
        where = torch.tensor(entries, dtype=torch.long).T.to(self.device)  # [3, m]: slot, table entry, block
        self.block_tables[where[0], where[1]] = where[2].to(torch.int32)

    # ---- the fixed-shape step (device work only: no host syncs, no shape that varies within a bucket) ----

    def keys(self, r: int, key_len: int) -> StepKeys:
        """What the attention of a step over slots `0..r` reads (`kv_cache.StepKeys`)."""
        return StepKeys(self.block_tables[:r], key_len, self.splits.get(r, 1))

    def draft(self, r: int, key_len: int, w: int, committed=None, request_ids=None):
        """`w` draft tokens for slots `0..r` into `self.drafts[:r, :w]`."""
        self.drafts[:r, :w] = self.proposer.propose(r, self.anchor[:r], self.lens[:r], self.keys(r, key_len), w,
                                                    committed, request_ids)

    def verify(self, r: int, key_len: int, w: int, mode: StepMode, context: bool | None = True,
               mask: ConstraintMask | None = None):
        """Verify `[anchor, drafts[:w]]` for slots `0..r` (their keys below `key_len`: `StepKeys`), accept (as `mode`
        asks), advance the rows and write `self.packed[:r, :w+3]` = (accepted, tokens, near-ties), with `mode.logprobs`
        also `self.logprobs` and `self.logprob_ids` (`read_output` reads them); `context`: also feed the draft's
        context (None: nor keep the taps for later, `ContextRing.keeps`); `mask`: a constrained step's
        (`RowSampling.accept`)."""
        lens, remaining = self.lens[:r], self.remaining[:r]
        verify_ids = torch.cat([self.anchor[:r, None], self.drafts[:r, :w]], 1)  # [r, W+1]
        positions = lens[:, None] + self.verify_offsets[:w + 1]                  # [r, W+1]
        keys = self.keys(r, key_len)
        attention = RowAttention(self.kv, self.kv.flat_index(keys.tables, positions), keys,
                                 query_limits(positions + 1, self.groups))  # causal after the prefix
        defer = self.ring.keeps(w, context)  # a W = 0 step's taps wait in the ring, whether or not they will be fed
        hidden, taps = run_decoder(self.decoder, self.layers, verify_ids, positions, attention,
                                   self.tap_layers if context or defer else (), join_taps=not defer,
                                   cos_sin=self.cos_sin)
        logits = self.lm_head(hidden)  # [r, W+1, V]
        limit = remaining - 1          # drafts that fit the row's budget beside the bonus
        accepted, tokens, ties = self.sampling.accept(slice(0, r), logits, verify_ids[:, 1:], limit, positions, mode,
                                                      mask)
        if mode.logprobs is not None:
            values, ids = token_logprobs(logits, tokens, mode.logprobs)
            self.logprobs[:r, :w + 1, :mode.logprobs + 1], self.logprob_ids[:r, :w + 1, :mode.logprobs] = values, ids
        if defer:
            self.ring.hold(taps)
        elif taps is not None:
            self.proposer.append_context(keys.tables, taps, lens)
        if mode.penalized:
            self.sampling.penalties.commit(slice(0, r), tokens, accepted, remaining > 0)
        advance = torch.where(remaining > 0, accepted + 1, 0)  # padding slots (remaining 0) stay put
        self.packed[:r, 0] = accepted
        self.packed[:r, 1:w + 2] = tokens
        self.packed[:r, w + 2] = 0 if ties is None else ties
        self.anchor[:r] = tokens.gather(1, accepted[:, None])[:, 0]
        lens += advance
        remaining -= advance

    def read_output(self, n: int, w: int, logprobs: int | None = None, forced: list[int] = ()) -> StepOutput:
        """The outcome of a step at width `w` for slots `0..n`, read to the host at one sync: accepted counts, tokens
        and near-ties, and with `logprobs` (the step's N) the positions' logprobs and top ids; `forced`: each row's
        forced drafts (a constrained step's, for the statistics)."""
        views = [(self.packed[:n, :w + 3], self.packed_host[:n, :w + 3])]
        if logprobs is not None:
            views += [(self.logprobs[:n, :w + 1, :logprobs + 1], self.logprobs_host[:n, :w + 1, :logprobs + 1]),
                      (self.logprob_ids[:n, :w + 1, :logprobs], self.logprob_ids_host[:n, :w + 1, :logprobs])]
        if self.device.type == "cuda":
            for device, host in views:
                host.copy_(device, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        packed, *lp = [(host if self.device.type == "cuda" else device).tolist() for device, host in views]  # [n, W+3]
        return StepOutput(w, [row[0] for row in packed], [row[1:w + 2] for row in packed],
                          [row[w + 2] for row in packed], *(lp or (None, None)), forced=list(forced))

    # ---- slots ------------------------------------------------------------------------------------

    def move_slots(self, src_index, dst_index):
        """Slot `src` -> `dst` (ints), or slots `src[i]` -> `dst[i]` (index tensors `[m]`; the pairs may form cycles):
        the row state and the block table (the keys stay where they are)."""
        for t in (self.lens, self.anchor, self.remaining, self.block_tables):
            t[dst_index] = t[src_index]  # an index tensor gathers the sources first
        self.sampling.move(src_index, dst_index)

    def free_slot(self, slot: int):
        """A free slot is an inert padding row: it never advances, and writes into the null block."""
        self.lens[slot] = 0
        self.remaining[slot] = 0
        self.block_tables[slot] = 0
