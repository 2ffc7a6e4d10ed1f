"""Test and benchmark oracles: a proposer that knows the target's continuation, and the slow O(K^2)
form of the Domino correction (the reference test harness's), against which the engine's fast paths
are checked. Benchmarks import this module too (they put tests/ on sys.path)."""

from __future__ import annotations

import torch
from torch import nn

from domino_ray.spec_decode.draft import DominoDraft


class OracleProposer:
    """Proposes the target's own continuation, wrong from a chosen draft position.

    `references[request_id]` is the target's full token sequence (prompt + continuation).
    `wrong_at[request_id][s % len]` is the first wrong draft index at the row's s-th step (K = all right);
    without it every draft is right. `shadow`, if given, is a real proposer run alongside and ignored,
    so benchmarks pay the real draft's cost at forced full acceptance.
    """

    graph_safe = False  # drafts come from host-side references

    def __init__(self, references: dict, num_spec_tokens: int, vocab_size: int, wrong_at: dict | None = None,
                 shadow=None):
        self.references = {k: list(v) for k, v in references.items()}
        self.num_spec_tokens, self.vocab_size = num_spec_tokens, vocab_size
        self.wrong_at = wrong_at or {}
        self.shadow = shadow
        self.target_layer_ids = shadow.target_layer_ids if shadow else ()
        self.block_size = shadow.block_size if shadow else 1
        self.calls: dict = {}

    def allocate(self, num_blocks: int, block_size: int, max_len: int):
        if self.shadow:
            self.shadow.allocate(num_blocks, block_size, max_len)

    def append_context(self, tables, target_hidden, offsets):
        if self.shadow:
            self.shadow.append_context(tables, target_hidden, offsets)

    def propose(self, r, anchor, offsets, keys, width, committed, request_ids) -> torch.Tensor:
        if self.shadow:
            self.shadow.propose(r, anchor, offsets, keys, width, committed, request_ids)
        k = width
        drafts = [[0] * k for _ in range(r)]  # padding slots get zeros
        for i, (rid, done) in enumerate(zip(request_ids, committed)):
            ref = self.references[rid]
            step = self.calls.get(rid, 0)
            self.calls[rid] = step + 1
            schedule = self.wrong_at.get(rid)
            wrong = schedule[step % len(schedule)] if schedule else self.num_spec_tokens
            row = (ref[done:done + k] + [0] * k)[:k]
            drafts[i] = [t if j < wrong else (t + 1) % self.vocab_size for j, t in enumerate(row)]
        return torch.tensor(drafts, dtype=torch.long, device=anchor.device).reshape(r, k)


def corrected_logits_full_prefix(draft: DominoDraft, hidden: torch.Tensor, anchor: torch.Tensor,
                                 drafts: torch.Tensor, embed: nn.Module, target_lm_head: nn.Module) -> torch.Tensor:
    """Slow oracle: logits `[b, K, Vd]` for given drafts `[b, K]`, rerunning `nn.GRU` over the whole prefix
    for every position (the O(K^2) form of the reference test harness)."""
    k = drafts.shape[1]
    z = draft.select_draft_hidden(hidden, k)
    base = draft.base_logits(z, target_lm_head)
    out = base.clone()
    seq = torch.cat([anchor[:, None], drafts], 1)  # [b, K+1]
    for i in range(draft.config.num_uncorrected, k):
        _, s = draft.prefix_gru(embed(seq[:, :i + 1]).to(draft.prefix_gru.weight_hh_l0.dtype))
        delta = draft.embed_proj(torch.cat([z[:, i].to(s.dtype), s[0]], -1))
        out[:, i] = base[:, i] + delta.to(base.dtype)
    return out
