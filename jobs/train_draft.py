"""Train a Domino (or plain DFlash) draft for your own target, then check it in the real engine.

    python jobs/train_draft.py --target Qwen/Qwen3-0.6B --prompts my_prompts.parquet --chat-template \
        --out drafts/qwen3-0.6b-domino --layers 2 --block-size 8 --steps 4000 --device cuda

1. The target generates greedy continuations of `--prompts` (a Parquet file with a `prompt` column;
   use prompts from the domain you will serve) with our engine: the draft learns the target's own outputs.
2. The draft (hidden size, heads and RoPE of the target; `--layers` decoder layers; Domino GRU head
   unless `--no-head`) trains on them (domino_ray/training/loop.py: random anchors, [anchor, MASK...]
   blocks, target hidden-state context, position-weighted loss, base-anchored curriculum), logging
   per-position accuracy and the acceptance length it implies.
3. It is saved in the HF/DFlash layout that `domino_ray.spec_decode.checkpoint.load_draft` reads (plus
   `training.json`), and with `--eval-prompts` measured in the engine (greedy, target verifies).

The generated sequences can be cached (`--sequences`, saved chunk by chunk: a stopped run resumes) and reused
by later runs, e.g. for ablations.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from domino_ray.target.loading import (encode_prompt, load_target, load_tokenizer, resolve_device, resolve_dtype,
                                     stop_token_ids)
from domino_ray.spec_decode.checkpoint import save_draft, save_draft_speculators
from domino_ray.spec_decode.draft import DominoDraft
from domino_ray.training.data import frequent_ids, generate_sequences, init_pruned_vocabulary, sequence_features
from domino_ray.training.evaluation import backbone_only, engine_acceptance
from domino_ray.training.loop import draft_config_for, train_draft
from domino_ray.training.objective import TrainConfig, target_to_draft_ids


def read_prompts(path: Path, column: str, limit: int | None) -> list[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if column not in table.column_names:
        raise SystemExit(f"error: {path} has no column {column!r} (columns: {table.column_names})")
    prompts = [p for p in table.column(column).to_pylist() if isinstance(p, str) and p.strip()]
    if not prompts:
        raise SystemExit(f"error: {path} column {column!r} holds no non-empty prompts")
    return prompts[:limit]


def mask_token_id(args, tokenizer, target_config) -> int:
    """--mask-token-id, else the tokenizer's mask token, else an embedding row no token uses."""
    if args.mask_token_id is not None:
        return args.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    if target_config.vocab_size > len(tokenizer):
        return target_config.vocab_size - 1  # padding rows exist (Qwen3 uses 151669 the same way)
    raise SystemExit("error: the tokenizer has no mask token and no unused embedding row; pass --mask-token-id")


def encode_all(tokenizer, prompts: list[str], chat: bool, max_len: int) -> list[list[int]]:
    """The prompts' token ids, without those of `max_len` tokens or more."""
    encoded = [encode_prompt(tokenizer, prompt=p, chat_template=chat) for p in prompts]
    kept = [ids for ids in encoded if len(ids) < max_len]
    if len(kept) < len(encoded):
        print(f"skipped {len(encoded) - len(kept)} prompts longer than {max_len - 1} tokens")
    return kept


def generate_cached(target, prompts: list[list[int]], cache: Path | None, *, chunk: int, **generate_kwargs):
    """The target's greedy continuations of `prompts`, generated `chunk` prompts at a time; with `cache`
    each finished chunk is saved there (a stopped run resumes after the last saved chunk, a finished
    cache is reused as is)."""
    sequences = torch.load(cache) if cache is not None and cache.exists() else []
    if sequences:
        print(f"loaded {len(sequences)} sequences from {cache}")
    start, done_before = time.perf_counter(), len(sequences)
    for i in range(len(sequences), len(prompts), chunk):
        sequences += generate_sequences(target, prompts[i:i + chunk], **generate_kwargs)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(sequences, cache.with_suffix(".tmp"))
            cache.with_suffix(".tmp").replace(cache)  # atomic: a kill mid-save keeps the previous chunks
        generated = sum(len(s) - n for s, n in sequences[done_before:])
        print(f"generated {len(sequences)}/{len(prompts)} prompts, {generated} new tokens "
              f"({time.perf_counter() - start:.0f}s)", flush=True)  # after the save: what it says is on disk
    return sequences


def features_cached(target, sequences, layer_ids, directory: Path | None, *, chunk: int) -> list[torch.Tensor]:
    """`sequence_features` of every sequence, `chunk` sequences per file in `directory` (a stopped run
    resumes after the last saved file; the layer ids are part of the file names)."""
    out, start = [], time.perf_counter()
    tag = "-".join(str(i) for i in layer_ids)
    for i in range(0, len(sequences), chunk):
        path = directory / f"features-L{tag}-{i:06d}-{min(i + chunk, len(sequences)):06d}.pt" if directory else None
        if path is not None and path.exists():
            out += torch.load(path)
            continue
        part = sequence_features(target, sequences[i:i + chunk], layer_ids)
        if path is not None:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(part, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        out += part
        print(f"features {len(out)}/{len(sequences)} sequences ({time.perf_counter() - start:.0f}s)", flush=True)
    return out


def encode_eval_prompts(tokenizer, path: Path, count: int, chat: bool, max_len: int) -> list[list[int]]:
    """Held-out prompts from a `messages` column (chat turns, as shipped for SmolLM2) or a `prompt` column."""
    import pyarrow.parquet as pq

    if "messages" in pq.read_schema(path).names:
        rows = pq.read_table(path, columns=["messages"]).column("messages").to_pylist()[:count]
        encoded = [encode_prompt(tokenizer, messages=m) for m in rows]
        return [ids for ids in encoded if len(ids) < max_len]
    return encode_all(tokenizer, read_prompts(path, "prompt", count), chat, max_len)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target: local directory or hub id")
    p.add_argument("--prompts", type=Path, required=True, help="Parquet file of training prompts")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--chat-template", action="store_true", help="wrap prompts as one user turn")
    p.add_argument("--out", type=Path, required=True, help="directory for the draft checkpoint")
    p.add_argument("--sequences", type=Path, default=None, help="cache of generated sequences (.pt), reused if present")
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens the target generates per prompt")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generated tokens per row (default: the target's limit, at most 4096); bounds the KV cache")
    p.add_argument("--gen-batch", type=int, default=32, help="rows the engine generates at once")
    p.add_argument("--gen-chunk", type=int, default=256, help="prompts per saved chunk of --sequences (resume unit)")
    p.add_argument("--generate-only", action="store_true", help="stop after generating (and caching) the sequences")
    p.add_argument("--features", type=Path, default=None,
                   help="directory caching the target's hidden states of every sequence (computed once instead of "
                        "every step: on a CPU the target's forward dominates); resumable")
    p.add_argument("--features-only", action="store_true", help="stop after computing (and caching) the features")
    p.add_argument("--checkpoint", type=Path, default=None, help="training state file: saved every 100 steps, resumed")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="pruned draft vocabulary: the N ids most frequent in the generated text (d2t/t2d)")
    p.add_argument("--save-dtype", default=None, help="dtype of the saved weights (e.g. bfloat16; default: as trained)")
    p.add_argument("--layout", choices=("dflash", "speculators"), default=None,
                   help="checkpoint layout (default: dflash, speculators with --draft-vocab-size)")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--target-layer-ids", default=None, help="comma-separated target layers for the context")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--no-head", action="store_true", help="plain DFlash draft (no GRU correction head)")
    p.add_argument("--emb-dim", type=int, default=128, help="Domino head bottleneck E")
    p.add_argument("--gru-hidden-dim", type=int, default=256, help="Domino GRU state size G")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=None, help="position-weight decay (default: 4 for B=8, 7 for B=16)")
    p.add_argument("--lambda-decay-ratio", type=float, default=0.5, help="fraction of steps over which lambda_base 1 -> 0")
    p.add_argument("--holdout", type=int, default=64, help="generated sequences kept out of training for eval logs")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", help="target and draft dtype while training")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                   help="mixed-precision training forward (weights stay fp32); bfloat16 is ~2.5x faster on AMX CPUs")
    p.add_argument("--eval-prompts", type=Path, default=None, help="Parquet of held-out prompts: engine check")
    p.add_argument("--eval-count", type=int, default=64)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    target = load_target(args.target, dtype=args.dtype, device=device)
    tokenizer = load_tokenizer(args.target)
    eos = stop_token_ids(target, tokenizer)
    max_len = min(x for x in (args.max_model_len, getattr(target.config, "max_position_embeddings", None), 4096) if x)

    prompts = encode_all(tokenizer, read_prompts(args.prompts, args.prompt_column, args.num_prompts),
                         args.chat_template, max_len - args.max_new_tokens + 1)  # prompt + answer fit in max_len
    sequences = generate_cached(target, prompts, args.sequences, chunk=args.gen_chunk,
                                max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch,
                                eos_token_ids=eos, max_model_len=max_len)
    if args.generate_only:
        return
    train_seqs, eval_seqs = sequences[:len(sequences) - args.holdout], sequences[len(sequences) - args.holdout:]

    layer_ids = tuple(int(x) for x in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    draft_cfg = draft_config_for(target.config, mask_token_id=mask_token_id(args, tokenizer, target.config),
                                 num_layers=args.layers, block_size=args.block_size, target_layer_ids=layer_ids,
                                 head=not args.no_head, emb_dim=args.emb_dim, gru_hidden_dim=args.gru_hidden_dim,
                                 draft_vocab_size=args.draft_vocab_size)
    features = eval_features = None
    if args.features is not None:
        all_features = features_cached(target, sequences, draft_cfg.target_layer_ids, args.features, chunk=args.gen_chunk)
        features, eval_features = all_features[:len(train_seqs)], all_features[len(train_seqs):]
        if args.features_only:
            return
    gamma = args.gamma if args.gamma is not None else {8: 4.0, 10: 5.0, 16: 7.0}.get(args.block_size, args.block_size / 2)
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, anchors_per_sequence=args.anchors,
                            lr=args.lr, gamma=gamma, lambda_base_decay_ratio=args.lambda_decay_ratio, seed=args.seed,
                            log_every=args.log_every, autocast=args.autocast)
    torch.manual_seed(args.seed)
    draft = DominoDraft(draft_cfg).to(device=device, dtype=target.dtype)
    if draft_cfg.has_d2t:
        draft_ids = frequent_ids(train_seqs, args.draft_vocab_size, draft_cfg.vocab_size)
        init_pruned_vocabulary(draft, target, draft_ids)
        covered = target_to_draft_ids(draft, draft_cfg.vocab_size)
        generated = torch.tensor([t for seq, n in train_seqs for t in seq[n:]])
        print(f"pruned vocabulary: {args.draft_vocab_size} ids cover "
              f"{(covered[generated] >= 0).float().mean().item():.2%} of the generated training tokens")
    print(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters, {draft_cfg}")
    history = train_draft(draft, target, train_seqs, train_cfg, log=lambda s: print(s, flush=True),
                          eval_sequences=eval_seqs or None, features=features, eval_features=eval_features,
                          checkpoint=args.checkpoint)
    layout = args.layout or ("speculators" if draft_cfg.has_d2t else "dflash")
    saved = copy.deepcopy(draft).to(resolve_dtype(args.save_dtype)) if args.save_dtype else draft
    if layout == "speculators":
        save_draft_speculators(saved, args.out, verifier=str(args.target))
    else:
        save_draft(saved, args.out)
    record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "train_config": vars(train_cfg), "history": history}
    if args.eval_prompts is not None:
        record["engine"] = evaluate_in_engine(args, target, tokenizer, draft, eos, max_len)
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def evaluate_in_engine(args, target, tokenizer, draft, eos, max_len: int) -> dict:
    """Acceptance of the trained draft (and of its backbone alone) in the real engine on held-out prompts."""
    prompts = encode_eval_prompts(tokenizer, args.eval_prompts, args.eval_count, args.chat_template,
                                  max_len - args.eval_max_new_tokens + 1)
    results = {}
    candidates = [("domino", draft)] + ([("backbone_only", backbone_only(draft))] if draft.config.has_head else [])
    for name, candidate in candidates:
        result = engine_acceptance(target, candidate, prompts, max_new_tokens=args.eval_max_new_tokens,
                                   eos_token_ids=eos, max_model_len=max_len)
        result.pop("token_ids")
        results[name] = result
        print(f"engine, {len(prompts)} held-out prompts, {name}: mean acceptance length "
              f"{result['mean_acceptance_length']:.2f}, per position "
              f"{' '.join(f'{x:.2f}' for x in result['per_position_acceptance'])}")
    return results


if __name__ == "__main__":
    main()
