"""The device side of the engine: the per-slot buffers at fixed addresses and the work on them.

`StepRunner` holds the target's KV buffers, each slot's row state (`lens`, `anchor`, `remaining`, its sampling
parameters) and a step's outputs, and runs the target forwards over them: a prefill into some slots, and the
fixed-shape step over slots `0..r` (draft W tokens, verify them, accept, advance the rows). The step is pure device
work (no host sync, no shape that varies within a bucket), so on CUDA each step key is one graph (`step_graphs.py`);
the host reads its outcome once, through `read_packed`. Which rows sit in which slot, and when a step runs at which
width over which key groups, is the engine's (`spec_engine.py`).
"""

from __future__ import annotations

import torch

from domino_ray.engine.context_ring import ContextRing
from domino_ray.model.key_groups import Groups
from domino_ray.model.kv_cache import KVBuffers, group_visibility
from domino_ray.model.target_forward import RowAttention, rotary_table, run_decoder
from domino_ray.spec.sampling import RowSampling, StepMode, token_logprobs
from domino_ray.spec.sampling_params import MAX_LOGPROBS


class StepRunner:
    """`rows` slots of up to `capacity` positions for `target` (its `layers` as the engine runs them, `fused_layers`)
    and `proposer` (None: target only; its state allocated here too); W = 0 steps' taps wait in `ring`."""

    def __init__(self, target, layers, proposer, ring: ContextRing, *, rows: int, capacity: int):
        cfg = target.config
        self.decoder, self.lm_head, self.layers = target.get_decoder(), target.get_output_embeddings(), layers
        self.proposer, self.ring = proposer, ring
        weight = next(target.parameters())
        self.device = dev = weight.device
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k = proposer.num_spec_tokens if proposer is not None else 0
        r = rows
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv = KVBuffers(cfg.num_hidden_layers, r, capacity, cfg.num_key_value_heads, head_dim, weight.dtype, dev)
        self.tap_layers: tuple[int, ...] = ()
        if proposer is not None:  # its target_layer_ids are in range: `checkpoint.check_against_target`
            proposer.allocate(r, capacity)
            self.tap_layers = tuple(proposer.target_layer_ids)
        self.lens = torch.zeros(r, dtype=torch.long, device=dev)       # [R] committed positions in the KV
        self.anchor = torch.zeros(r, dtype=torch.long, device=dev)     # [R] last committed token
        self.remaining = torch.zeros(r, dtype=torch.long, device=dev)  # [R] tokens the row may still emit; 0 = free
        self.sampling = RowSampling(r, cfg.vocab_size, dev, weight.dtype)
        self.drafts = torch.zeros(r, k, dtype=torch.long, device=dev)  # [R, K] the draft step's output
        self.packed = torch.zeros(r, k + 2, dtype=torch.long, device=dev)  # [R, 1 + K+1] accepted, tokens
        pinned = dev.type == "cuda"
        self.packed_host = torch.zeros(r, k + 2, dtype=torch.long, pin_memory=pinned)
        # Each verified position's logprobs when a row asks: the token's then the top N's, and the top N's ids.
        lp_dtype, lp_shape = self.sampling.penalties.dtype, (r, k + 1, 1 + MAX_LOGPROBS)
        self.logprobs = torch.zeros(lp_shape, dtype=lp_dtype, device=dev)                    # [R, K+1, 1+N]
        self.logprob_ids = torch.zeros(r, k + 1, MAX_LOGPROBS, dtype=torch.long, device=dev)  # [R, K+1, N]
        self.logprobs_host = torch.zeros(lp_shape, dtype=lp_dtype, pin_memory=pinned)
        self.logprob_ids_host = torch.zeros(r, k + 1, MAX_LOGPROBS, dtype=torch.long, pin_memory=pinned)
        self.verify_offsets = torch.arange(k + 1, device=dev)        # [K+1]
        self.key_positions = torch.arange(capacity, device=dev)       # [T]
        self.cos_sin = rotary_table(self.decoder, capacity, weight.dtype)  # ([T, D], [T, D]) or None

    def prefill(self, ids: torch.Tensor, sizes: list[int], rows: slice, ints: torch.Tensor, params: list, seeds: list,
                stop_ids: list, mode: StepMode) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """One target forward over prompts `ids [1, N]` laid back to back (`sizes` tokens each, no padding) into slots
        `rows`, with their sampling `params`, `seeds` and `stop_ids` (for min_tokens); `ints [k, 3]`: each prompt's
        length, tokens it may emit after the first, last token's index in `ids`. Returns the first tokens `[k]`, the
        prompts' taps `[1, N, F]` (None without tap layers) and, when `mode.logprobs` is set, the first tokens'
        logprobs (`token_logprobs`' pair at one position)."""
        lengths, last_token = ints[:, 0], ints[:, 2]
        ids = ids.to(self.device)
        self.sampling.load(rows, params, seeds)
        self.sampling.penalties.load(rows, params, stop_ids, ids[0], sizes, mode.penalized)
        positions = torch.cat([self.key_positions[:m] for m in sizes])[None]  # [1, N]: every prompt starts at 0
        hidden, taps = run_decoder(self.decoder, self.layers, ids, positions,
                                   RowAttention(self.kv, write_index=positions, prefill_rows=rows,
                                                prefill_lengths=tuple(sizes)), self.tap_layers, cos_sin=self.cos_sin)
        last = hidden[0, last_token]  # [k, C]
        # The first token is an acceptance step with zero drafts at the prompt's last position.
        no_drafts = torch.zeros(len(sizes), 0, dtype=torch.long, device=self.device)
        logits = self.lm_head(last)[:, None]  # [k, 1, V]
        zero = torch.zeros_like(lengths)
        _, first = self.sampling.accept(rows, logits, no_drafts, zero, (lengths - 1)[:, None], mode)
        if mode.penalized:  # the first token is a generated one
            self.sampling.penalties.commit(rows, first, zero, torch.ones_like(lengths, dtype=torch.bool))
        logprobs = token_logprobs(logits, first, mode.logprobs) if mode.logprobs is not None else None
        first = first[:, 0]  # [k]
        self.lens[rows] = lengths
        self.anchor[rows] = first
        self.remaining[rows] = ints[:, 1]
        return first, taps, logprobs

    # ---- the fixed-shape step (device work only: no host syncs, no shape that varies within a bucket) ----

    def draft(self, r: int, key_groups: Groups, w: int, committed=None, request_ids=None):
        """`w` draft tokens for slots `0..r` into `self.drafts[:r, :w]`."""
        self.drafts[:r, :w] = self.proposer.propose(r, self.anchor[:r], self.lens[:r], key_groups, w, committed,
                                                    request_ids)

    def verify(self, r: int, key_groups: Groups, w: int, mode: StepMode, context: bool | None = True):
        """Verify `[anchor, drafts[:w]]` for slots `0..r` over `key_groups`, accept (as `mode` asks), advance the rows
        and write `self.packed[:r, :w+2]` = (accepted, tokens), with `mode.logprobs` also `self.logprobs` and
        `self.logprob_ids`; `context`: also feed the draft's context (None: nor keep the taps for later,
        `ContextRing.keeps`)."""
        lens, remaining = self.lens[:r], self.remaining[:r]
        verify_ids = torch.cat([self.anchor[:r, None], self.drafts[:r, :w]], 1)  # [r, W+1]
        positions = lens[:, None] + self.verify_offsets[:w + 1]                  # [r, W+1]
        # causal after the prefix
        visible = group_visibility(positions + 1, self.groups, self.key_positions, key_groups, self.kv)
        defer = self.ring.keeps(w, context)  # a W = 0 step's taps wait in the ring, whether or not they will be fed
        hidden, taps = run_decoder(self.decoder, self.layers, verify_ids, positions,
                                   RowAttention(self.kv, write_index=positions, visible=visible, key_groups=key_groups),
                                   self.tap_layers if context or defer else (), join_taps=not defer,
                                   cos_sin=self.cos_sin)
        logits = self.lm_head(hidden)  # [r, W+1, V]
        limit = remaining - 1          # drafts that fit the row's budget beside the bonus
        accepted, tokens = self.sampling.accept(slice(0, r), logits, verify_ids[:, 1:], limit, positions, mode)
        if mode.logprobs is not None:
            values, ids = token_logprobs(logits, tokens, mode.logprobs)
            self.logprobs[:r, :w + 1, :mode.logprobs + 1], self.logprob_ids[:r, :w + 1, :mode.logprobs] = values, ids
        if defer:
            self.ring.hold(taps)
        elif taps is not None:
            self.proposer.append_context(slice(0, r), taps, lens)
        if mode.penalized:
            self.sampling.penalties.commit(slice(0, r), tokens, accepted, remaining > 0)
        advance = torch.where(remaining > 0, accepted + 1, 0)  # padding slots (remaining 0) stay put
        self.packed[:r, 0] = accepted
        self.packed[:r, 1:w + 2] = tokens
        self.anchor[:r] = tokens.gather(1, accepted[:, None])[:, 0]
        lens += advance
        remaining -= advance

    def read_packed(self, n: int, w: int, logprobs: int | None = None) -> tuple[list, list | None, list | None]:
        """Rows `0..n` of (accepted, W+1 tokens), read to the host, and with `logprobs` (the step's N) their
        positions' logprobs and top ids (`[n, W+1, 1+N]`, `[n, W+1, N]`) at the same sync."""
        views = [(self.packed[:n, :w + 2], self.packed_host[:n, :w + 2])]
        if logprobs is not None:
            views += [(self.logprobs[:n, :w + 1, :logprobs + 1], self.logprobs_host[:n, :w + 1, :logprobs + 1]),
                      (self.logprob_ids[:n, :w + 1, :logprobs], self.logprob_ids_host[:n, :w + 1, :logprobs])]
        if self.device.type == "cuda":
            for device, host in views:
                host.copy_(device, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        out = [(host if self.device.type == "cuda" else device).tolist() for device, host in views]
        return out[0], *(out[1:] if logprobs is not None else (None, None))

    # ---- slots ------------------------------------------------------------------------------------

    def move_slots(self, src_index, dst_index, length: int):
        """Slot `src` -> `dst` (ints), or slots `src[i]` -> `dst[i]` (index tensors `[m]`; the pairs may form cycles):
        the first `length` KV positions, the proposer's state and the row state."""
        self.kv.move_row(src_index, dst_index, length)
        if self.proposer is not None:
            self.proposer.move_row(src_index, dst_index, length)
        for t in (self.lens, self.anchor, self.remaining):
            t[dst_index] = t[src_index]  # an index tensor gathers the sources first
        self.sampling.move(src_index, dst_index)

    def free_slot(self, slot: int):
        """A free slot is an inert padding row: it never advances."""
        self.lens[slot] = 0
        self.remaining[slot] = 0
