"""Proposers: what the engine asks for draft tokens each step.

A proposer is any object with these members (duck-typed; the engine needs nothing else):
- `num_draft_tokens`: K, drafts per step.
- `target_layer_ids`: target layers whose outputs it needs as context (empty: none).
- `allocate(max_rows, max_len)`: reserve per-row state once.
- `append_context(rows, target_hidden, offsets)`: new target hidden states `[b, q, L*C]` of committed
  positions `offsets[b] + arange(q)`; entries past a row's committed length are junk it must tolerate.
- `propose(rows, anchor, offsets, committed, request_ids) -> [b, K]`: drafts after `anchor [b]` at
  positions `offsets [b]`; `committed[b]` is the row's committed token count (prompt + generated,
  known on the host, so `offsets[b] == committed[b] - 1` without a sync).
- `move_row(src, dst, length)`: slot compaction.

`DominoProposer` runs a Domino/DFlash draft. `OracleProposer` knows the target's continuation and is
wrong from a chosen position: it exercises every acceptance length in tests and gives the
full-acceptance upper bound in benchmarks.
"""

from __future__ import annotations

import torch

from domino_ray.draft import DominoDraft
from domino_ray.kv_cache import KVBuffers, additive_mask, write_index


class DominoProposer:
    def __init__(self, draft: DominoDraft, target, num_draft_tokens: int | None = None):
        cfg = draft.config
        k = cfg.max_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if not 1 <= k <= cfg.max_draft_tokens:
            raise ValueError(f"num_draft_tokens={k} is out of range: this draft (block_size={cfg.block_size}, "
                             f"shift_label={cfg.shift_label}) proposes 1..{cfg.max_draft_tokens} tokens per step")
        self.draft, self.config, self.num_draft_tokens = draft, cfg, k
        self.target_layer_ids = cfg.target_layer_ids
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        weight = next(draft.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        with torch.inference_mode():
            mask_id = torch.tensor([cfg.mask_token_id], device=self.embed.weight.device)
            self.mask_embedding = self.embed(mask_id).to(self.device, self.dtype)  # [1, C]
        self.kv: KVBuffers | None = None

    def allocate(self, max_rows: int, max_len: int):
        cfg = self.config
        # The block is written as scratch just past the committed context, hence the extra room.
        self.kv = KVBuffers(cfg.num_hidden_layers, max_rows, max_len + cfg.block_size, cfg.num_key_value_heads,
                            cfg.head_dim, self.dtype, self.device)

    def append_context(self, rows: slice, target_hidden: torch.Tensor, offsets: torch.Tensor):
        context = self.draft.project_context(target_hidden.to(self.device))  # [b, q, C]
        positions = write_index(offsets, context.shape[1])                  # [b, q]
        cos, sin = self.draft.rope(positions, self.dtype)
        for i, layer in enumerate(self.draft.layers):
            k, v = layer.self_attn.key_value(context, cos, sin)
            self.kv.write(i, rows, positions, k, v)

    def propose(self, rows: slice, anchor: torch.Tensor, offsets: torch.Tensor, committed, request_ids) -> torch.Tensor:
        block_size = self.config.block_size
        b = anchor.shape[0]
        block = torch.cat([self.embed(anchor)[:, None].to(self.dtype),
                           self.mask_embedding.expand(b, block_size - 1, -1)], 1)  # [b, B, C]
        positions = write_index(offsets, block_size)  # [b, B]
        kv_len = max(committed) - 1 + block_size  # host-known: no sync
        keys = torch.arange(kv_len, device=self.device)
        # Non-causal: every block slot sees the whole context and the whole block.
        visible = (keys[None, :] < (offsets + block_size)[:, None])[:, None, None, :]  # [b, 1, 1, kv_len]
        mask = additive_mask(visible, self.dtype)
        cos, sin = self.draft.rope(positions, self.dtype)

        def attend_layer(i, layer, x, cos, sin):
            q = layer.self_attn.query(x, cos, sin)
            k, v = layer.self_attn.key_value(x, cos, sin)
            self.kv.write(i, rows, positions, k, v)
            keys_i, values_i = self.kv.view(i, rows, kv_len)
            return layer.self_attn.attend(q, keys_i, values_i, mask)

        hidden = self.draft.run_layers(block, cos, sin, attend_layer)  # [b, B, C]
        return self.draft.draft_tokens(hidden, anchor, self.num_draft_tokens, self.embed, self.lm_head)

    def move_row(self, src: int, dst: int, length: int):
        self.kv.move_row(src, dst, length)


class OracleProposer:
    """Proposes the target's own continuation, wrong from a chosen draft position.

    `references[request_id]` is the target's full token sequence (prompt + continuation).
    `wrong_at[request_id][s % len]` is the first wrong draft index at the row's s-th step (K = all right);
    without it every draft is right. `shadow`, if given, is a real proposer run alongside and ignored,
    so benchmarks pay the real draft's cost at forced full acceptance.
    """

    def __init__(self, references: dict, num_draft_tokens: int, vocab_size: int, wrong_at: dict | None = None,
                 shadow=None):
        self.references = {k: list(v) for k, v in references.items()}
        self.num_draft_tokens, self.vocab_size = num_draft_tokens, vocab_size
        self.wrong_at = wrong_at or {}
        self.shadow = shadow
        self.target_layer_ids = shadow.target_layer_ids if shadow else ()
        self.calls: dict = {}

    def allocate(self, max_rows: int, max_len: int):
        if self.shadow:
            self.shadow.allocate(max_rows, max_len)

    def append_context(self, rows, target_hidden, offsets):
        if self.shadow:
            self.shadow.append_context(rows, target_hidden, offsets)

    def propose(self, rows, anchor, offsets, committed, request_ids) -> torch.Tensor:
        if self.shadow:
            self.shadow.propose(rows, anchor, offsets, committed, request_ids)
        k = self.num_draft_tokens
        drafts = []
        for rid, done in zip(request_ids, committed):
            ref = self.references[rid]
            step = self.calls.get(rid, 0)
            self.calls[rid] = step + 1
            schedule = self.wrong_at.get(rid)
            wrong = schedule[step % len(schedule)] if schedule else k
            row = (ref[done:done + k] + [0] * k)[:k]
            drafts.append([t if i < wrong else (t + 1) % self.vocab_size for i, t in enumerate(row)])
        return torch.tensor(drafts, dtype=torch.long, device=anchor.device).reshape(len(drafts), k)

    def move_row(self, src, dst, length):
        if self.shadow:
            self.shadow.move_row(src, dst, length)
