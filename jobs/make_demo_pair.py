"""Build the demo target shipped in `domino_ray/assets/demo`: corpus, tokenizer, target LM, prompts.

    python jobs/make_demo_pair.py --out domino_ray/assets/demo --work work/demo --threads 1

The corpus is the Python standard library source of the running interpreter (CPython 3.11.7 made the
shipped pair): every `*.py` under `sysconfig.get_paths()["stdlib"]` except tests, `site-packages`,
the generated `_sysconfigdata_*`, `encodings/` (codec tables) and `pydoc_data/` (one huge string).
A file is held out when `sha256(relative path) % 12 == 0` (about 1 in 12, listed in `corpus.json`);
held-out files give the shipped prompts and are never trained on, by the target or by the draft.

Steps (all seeded): a byte-level BPE tokenizer (4096 ids) on the training files; a Qwen3 target trained
from scratch on random 256-token windows of the training files (each file ends with `<|endoftext|>`,
the EOS the target emits); `prompts.parquet` (held-out function starts) in `--out`; the draft's
training prompts (training-file function starts and line windows) in `--work`. The draft is then
trained by `jobs/train_draft.py` (docs/demo-pairs.md "The demo pair").

A different Python version or stdlib contents (a distro may patch files) would build a different pair:
the script compares with the shipped `corpus.json` and refuses unless `--allow-different-corpus`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch

CORPUS_PYTHON = "3.11.7"  # the interpreter whose stdlib built the shipped pair
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "encodings"}
HOLD_OUT_MODULUS = 12
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]  # ids 0..3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 4096
SEQ_LEN = 256


# ---- corpus -----------------------------------------------------------------------------------------

def corpus_files(stdlib: Path) -> list[str]:
    """Relative paths of the corpus files, sorted."""
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HOLD_OUT_MODULUS == 0


def read_text(stdlib: Path, rel: str) -> str:
    return (stdlib / rel).read_text(encoding="utf-8", errors="replace")


def manifest(stdlib: Path) -> dict:
    files = corpus_files(stdlib)
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256((stdlib / rel).read_bytes()).digest())
    return {"python": platform.python_version(), "implementation": platform.python_implementation(),
            "rule": f"stdlib *.py except dirs {sorted(EXCLUDED_DIRS)} and _sysconfigdata_*; held out when "
                    f"sha256(relative path) % {HOLD_OUT_MODULUS} == 0",
            "sha256": digest.hexdigest(), "num_files": len(files),
            "held_out": [f for f in files if is_held_out(f)]}


def check_corpus(found: dict, shipped_path: Path, allow_different: bool):
    """Refuse (or, when allowed, warn) if this interpreter's corpus differs from the shipped pair's."""
    problems = []
    if found["python"] != CORPUS_PYTHON:
        problems.append(f"Python {found['python']} (the shipped pair used {CORPUS_PYTHON})")
    if shipped_path.exists():
        shipped = json.loads(shipped_path.read_text())
        if shipped["sha256"] != found["sha256"]:
            problems.append(f"stdlib corpus sha256 {found['sha256'][:12]}... differs from the shipped "
                            f"{shipped['sha256'][:12]}... ({found['num_files']} vs {shipped['num_files']} files)")
    if not problems:
        return
    message = "this corpus differs from the one that built the shipped pair: " + "; ".join(problems)
    if not allow_different:
        sys.exit(f"error: {message}. The result would not reproduce the shipped assets; pass "
                 "--allow-different-corpus to build a different pair anyway.")
    print(f"WARNING: {message}; building a different pair.", file=sys.stderr)


# ---- tokenizer and target -----------------------------------------------------------------------------

def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # <|mask|> fills the draft's block slots; the target never sees it.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>", chat_template=CHAT_TEMPLATE)


def target_config(tokenizer):
    from transformers import Qwen3Config

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Deep and narrow: a forward's fixed cost grows with depth, its per-token cost with width, so at small
    # batch verifying K+1 tokens costs little more than one, while the 2-layer draft stays cheap.
    return Qwen3Config(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=10,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=SEQ_LEN,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
                       pad_token_id=eos)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts, each followed by EOS, as one int64 stream `[N]`."""
    eos = tokenizer.eos_token_id
    ids = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """`[batch, SEQ_LEN]` random windows of the stream."""
    starts = torch.randint(0, len(stream) - SEQ_LEN, (batch,), generator=generator)
    return torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])


def train_target(model, train: torch.Tensor, held_out: torch.Tensor, *, steps: int, batch: int, lr: float,
                 seed: int, log_every: int = 50) -> dict:
    generator = torch.Generator().manual_seed(seed)
    eval_batch = windows(held_out, 32, torch.Generator().manual_seed(seed + 1))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    start, history = time.perf_counter(), []
    for step in range(1, steps + 1):
        model.train()
        ids = windows(train, batch, generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps:
            with torch.no_grad():
                model.eval()
                eval_loss = model(input_ids=eval_batch, labels=eval_batch).loss.item()
            elapsed = time.perf_counter() - start
            history.append({"step": step, "train_loss": round(loss.item(), 4), "held_out_loss": round(eval_loss, 4)})
            print(f"step {step}/{steps} loss {loss.item():.3f} held-out {eval_loss:.3f} "
                  f"lr {schedule.get_last_lr()[0]:.2e} {step * batch * SEQ_LEN / elapsed:.0f} tok/s "
                  f"{elapsed / 60:.1f} min", flush=True)
    return {"steps": steps, "batch": batch, "seq_len": SEQ_LEN, "lr": lr, "tokens": steps * batch * SEQ_LEN,
            "minutes": round((time.perf_counter() - start) / 60, 1), "final": history[-1]}


# ---- prompts ------------------------------------------------------------------------------------------

def function_starts(text: str) -> list[int]:
    """0-based line numbers of every `def` (functions and methods) in a source file."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return sorted(node.lineno - 1 for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list)


def prompt_at(lines: list[str], first: int, tokenizer, min_tokens: int, max_tokens: int) -> str | None:
    """Whole lines from `first` until at least `min_tokens` tokens; None if that exceeds `max_tokens`."""
    text = ""
    for line in lines[first:]:
        text += line
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > max_tokens:
            return None
        if n >= min_tokens and text.strip():
            return text
    return None


def make_prompts(stdlib: Path, files: list[str], tokenizer, count: int, seed: int, *, windows_too: bool,
                 min_tokens: int = 24, max_tokens: int = 64) -> list[dict]:
    """`count` prompts `{id, prompt}` (id = "path:line"): function starts, plus random line windows."""
    import random

    rng = random.Random(seed)
    candidates = []
    for rel in files:
        text = read_text(stdlib, rel)
        lines = text.splitlines(keepends=True)
        starts = [(rel, i) for i in function_starts(text)]
        if windows_too:
            starts += [(rel, rng.randrange(len(lines))) for _ in range(len(starts) + 1) if lines]
        candidates += starts
    rng.shuffle(candidates)
    prompts, seen = [], set()
    cache: dict[str, list[str]] = {}
    for rel, line in candidates:
        if len(prompts) == count:
            break
        if (rel, line) in seen:
            continue
        seen.add((rel, line))
        lines = cache.setdefault(rel, read_text(stdlib, rel).splitlines(keepends=True))
        text = prompt_at(lines, line, tokenizer, min_tokens, max_tokens)
        if text is not None:
            prompts.append({"id": f"{rel}:{line + 1}", "prompt": text})
    if len(prompts) < count:
        raise RuntimeError(f"only {len(prompts)} prompts found, {count} requested")
    return sorted(prompts, key=lambda p: p["id"])


def write_prompts(prompts: list[dict], path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": pa.array([p["id"] for p in prompts], pa.string()),
                      "prompt": pa.array([p["prompt"] for p in prompts], pa.string())})
    pq.write_table(table, path)


# ---- main ---------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("domino_ray/assets/demo"))
    parser.add_argument("--work", type=Path, default=Path("work/demo"), help="intermediate files (draft prompts)")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--num-prompts", type=int, default=300, help="held-out prompts shipped")
    parser.add_argument("--num-draft-prompts", type=int, default=6000, help="training prompts for the draft")
    parser.add_argument("--allow-different-corpus", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = manifest(stdlib)
    check_corpus(found, args.out / "corpus.json", args.allow_different_corpus)
    held = set(found["held_out"])
    files = corpus_files(stdlib)
    train_files = [f for f in files if f not in held]
    print(f"corpus: {stdlib} (Python {found['python']}), {len(train_files)} training files, {len(held)} held out")

    train_texts = [read_text(stdlib, f) for f in train_files]
    tokenizer = train_tokenizer(train_texts)
    train = token_stream(tokenizer, train_texts)
    held_out = token_stream(tokenizer, [read_text(stdlib, f) for f in sorted(held)])
    print(f"tokenizer: {len(tokenizer)} ids; {len(train)} training tokens, {len(held_out)} held-out tokens")

    from transformers import Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(target_config(tokenizer))
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    report = train_target(model, train, held_out, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)

    target_dir = args.out / "target"
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.to(torch.float32).save_pretrained(target_dir)
    tokenizer.model_max_length = SEQ_LEN  # set after tokenizing whole files for the stream
    tokenizer.save_pretrained(target_dir)
    write_prompts(make_prompts(stdlib, sorted(held), tokenizer, args.num_prompts, args.seed, windows_too=False),
                  args.out / "prompts.parquet")
    write_prompts(make_prompts(stdlib, train_files, tokenizer, args.num_draft_prompts, args.seed, windows_too=True),
                  args.work / "draft_prompts.parquet")
    found["target_training"] = report
    found["tokens"] = {"train": len(train), "held_out": len(held_out)}
    (args.out / "corpus.json").write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {target_dir}, {args.out / 'prompts.parquet'}, {args.out / 'corpus.json'}, "
          f"{args.work / 'draft_prompts.parquet'}")


if __name__ == "__main__":
    main()
