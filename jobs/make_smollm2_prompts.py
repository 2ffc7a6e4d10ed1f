"""Offline chat prompts for SmolLM2 from text every Python install has: stdlib functions and the
documentation topics of `pydoc_data/topics.py` (issue 11).

    python jobs/make_smollm2_prompts.py --out domino_ray/assets/smollm2 --work work/smollm2

Each *unit* (one stdlib function `path:qualname`, or one paragraph `topics:name#n`) gives one prompt of
one of these kinds, picked by a hash of the unit (independent of the split's):
- explain:   "Explain what this Python function does: <source>"     (functions of 4-30 lines)
- write:     "Write a Python function `name` that <docstring summary>"  (functions with a docstring)
- summarize: "Summarize this passage from the Python documentation: <paragraph>"
- question:  "In Python, what is <topic title>? Answer briefly."       (first paragraph of a topic)
A unit is held out when `sha256(unit) % 10 == 0`: its prompt goes to the shipped held-out set
(`prompts.parquet`, a `messages` column of one user turn), never to the draft's training prompts
(`--work/train_prompts.parquet`, a `prompt` column). The corpus is the running interpreter's stdlib,
so another Python version gives other prompts; `manifest.json` records version, counts and the rule.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import random
import sysconfig
import textwrap
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
HOLD_OUT_MODULUS = 10
MAX_PROMPT_CHARS = 1500  # about 400 tokens: short prompts leave the context to the answer


def unit_hash(unit: str) -> int:
    return int(hashlib.sha256(unit.encode()).hexdigest(), 16)


def is_held_out(unit: str) -> bool:
    return unit_hash(unit) % HOLD_OUT_MODULUS == 0


def stdlib_files(stdlib: Path) -> list[str]:
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or rel.name.startswith("_sysconfigdata"):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def function_prompts(rel: str, text: str) -> list[tuple[str, str, str]]:
    """`(unit, kind, prompt)` for the public functions of one source file."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        unit = f"{rel}:{node.name}:{node.lineno}"
        doc = ast.get_docstring(node)
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""
        source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        n_lines = node.end_lineno - node.lineno + 1
        can_explain = 4 <= n_lines <= 30 and len(source) <= MAX_PROMPT_CHARS
        can_write = 20 <= len(summary) <= 300 and not summary.lower().startswith(("deprecated", "internal"))
        kinds = [k for k, ok in (("explain", can_explain), ("write", can_write)) if ok]
        if not kinds:
            continue
        kind = kinds[unit_hash(unit + "#kind") % len(kinds)]  # not unit_hash(unit): that decides the split
        if kind == "explain":
            prompt = f"Explain what this Python function does:\n\n```python\n{source}\n```"
        else:
            prompt = f"Write a Python function `{node.name}` that does the following: {summary}"
        out.append((unit, kind, prompt))
    return out


def topic_prompts(topics: dict[str, str]) -> list[tuple[str, str, str]]:
    out = []
    for name, text in sorted(topics.items()):
        blocks = [b.strip() for b in text.split("\n\n")]
        title = blocks[0].splitlines()[0].strip() if blocks else name
        out.append((f"topics:{name}", "question", f"In Python, what is {title.strip('*').strip()}? Answer briefly."))
        for i, block in enumerate(blocks[1:], 1):
            if 200 <= len(block) <= MAX_PROMPT_CHARS and not block.startswith(("*", "   ")):
                out.append((f"topics:{name}#{i}", "summarize",
                            f"Summarize this passage from the Python documentation in two or three sentences:\n\n{block}"))
    return out


def all_prompts() -> list[tuple[str, str, str]]:
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    units = topic_prompts(topics)
    for rel in stdlib_files(stdlib):
        units += function_prompts(rel, (stdlib / rel).read_text(encoding="utf-8", errors="replace"))
    return units


def write_parquet(path: Path, rows: list[tuple[str, str, str]], *, messages: bool):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {"id": pa.array([u for u, _, _ in rows], pa.string()), "kind": pa.array([k for _, k, _ in rows], pa.string())}
    if messages:
        columns["messages"] = pa.array([[{"role": "user", "content": p}] for _, _, p in rows],
                                       pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    else:
        columns["prompt"] = pa.array([p for _, _, p in rows], pa.string())
    pq.write_table(pa.table(columns), path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("domino_ray/assets/smollm2"), help="held-out prompts + manifest")
    p.add_argument("--work", type=Path, default=Path("work/smollm2"), help="the draft's training prompts")
    p.add_argument("--num-held-out", type=int, default=300)
    p.add_argument("--num-train", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    units = all_prompts()
    held = [u for u in units if is_held_out(u[0])]
    train = [u for u in units if not is_held_out(u[0])]
    rng = random.Random(args.seed)
    rng.shuffle(held)
    rng.shuffle(train)
    held, train = held[:args.num_held_out], train[:args.num_train]
    write_parquet(args.out / "prompts.parquet", held, messages=True)
    write_parquet(args.work / "train_prompts.parquet", train, messages=False)
    count = lambda rows: {k: sum(1 for _, kind, _ in rows if kind == k) for k in ("explain", "write", "summarize", "question")}
    manifest = {"python": platform.python_version(),
                "sources": "stdlib *.py functions (public, not under test/tests/idle_test/encodings/site-packages) "
                           "and pydoc_data/topics.py",
                "split_rule": f"a unit (path:function:line or topics:name#paragraph) is held out when "
                              f"sha256(unit) % {HOLD_OUT_MODULUS} == 0; held-out units never give training prompts",
                "units": {"total": len(units), "held_out": sum(1 for u in units if is_held_out(u[0]))},
                "held_out_prompts": {"count": len(held), "kinds": count(held)},
                "train_prompts": {"count": len(train), "kinds": count(train)}, "seed": args.seed}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
