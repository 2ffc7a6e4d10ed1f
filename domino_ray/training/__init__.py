"""Training a Domino (or plain DFlash) draft for any HF causal-LM target, on CPU or GPU.

Recipe (reference/domino.md §1.4, §2.5):
- Data: the target's own greedy continuations of prompts (`generate_sequences`, our engine, target
  only), so every label is exactly what the draft must predict at inference.
- Random anchors p in the generated part of each sequence; per anchor one block `[x_p, MASK x (B-1)]`
  at positions p..p+B-1, embedded with the target's embedding. Several blocks share one sequence.
- Context: the target's hidden states at `target_layer_ids` (HF `hidden_states[l + 1]`, computed
  without gradients). A block's queries see context positions < p (strictly: at inference the anchor's
  own hidden state is not computed yet) plus their own block, non-causally (`training_mask`).
- Labels, in draft-index terms (i = 0..K-1, either `shift_label` layout): draft i predicts x_{p+1+i}.
  Its GRU state is teacher-forced on the true tokens x_p..x_{p+i} (target embeddings), the state
  `draft_tokens` reaches at inference once d_1..d_i were accepted, i.e. equal to the truth.
- Loss: `(1 - lam) * L_final + lam * L_base`, both position-weighted cross-entropies with weight
  `exp(-i / gamma)`; lam decays linearly from `lambda_base_start` to 0 over `lambda_base_decay_ratio`
  of training (base-anchored curriculum). A plain DFlash draft trains on L_base alone.

Logged per-position accuracy is teacher-forced, which for a prefix-accepting verifier is the exact
acceptance event, so `accept_len = 1 + sum_i P(drafts 0..i all right)` estimates the engine's mean
acceptance length on the same data.

Modules: `data.py` (sequences, anchors, features, the pruned vocabulary), `objective.py` (blocks, labels,
loss, accuracy), `loop.py` (the loop, checkpointing) and `evaluation.py` (teacher-forced and in the engine).
"""
