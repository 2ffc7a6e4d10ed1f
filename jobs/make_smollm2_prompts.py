"""Offline chat prompts for SmolLM2 from several sources every dev install has (issues 11, 20): code
(stdlib and third-party packages), prose (the Python documentation topics, packages' descriptions) and
templated general requests.

    python jobs/make_smollm2_prompts.py --out domino_ray/assets/smollm2 --work work/smollm2

Each *unit* (one function `pkg:name/path:qualname:line`, one paragraph, one generated request) gives one
prompt of one kind, picked by a hash of the unit (independent of the split's):
- explain:   "Explain what this Python function does: <source>"          (functions of 4-30 lines)
- write:     "Write a Python function `name` that does the following: <docstring summary>"
- complete:  "Complete this Python function: <signature, docstring, first half of the body>"
- summarize: "Summarize this passage from <the Python documentation | the documentation of pkg>"
- question:  "In Python, what is <topic title>?" / "What is the Python package <pkg> used for?"
- request:   templated general requests (short writing, lists, explanations, arithmetic, rewording)

Two held-out sets, both in the shipped `prompts.parquet` (`source` column) and never in the draft's training
prompts (`--work/train_prompts.parquet`):
- **by source**: everything from `HELD_OUT_PACKAGE` (its code and its description): a package the draft never
  saw, for the acceptance a user's own, unseen requests get;
- **by sample**: a unit of any other source when `sha256(unit) % 10 == 0`.
The corpus is what is installed (stdlib version, package versions): `manifest.json` records them.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import itertools
import json
import platform
import random
import sysconfig
import textwrap
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "test", "tests", "testing", "idle_test", "__pycache__", "encodings",
                 "pydoc_data", "_vendor", "vendored"}
HOLD_OUT_MODULUS = 10
MAX_PROMPT_CHARS = 1500  # about 400 tokens: short prompts leave the context to the answer
# Third-party packages whose code and description give training prompts (those installed are used).
TRAIN_PACKAGES = ("numpy", "pandas", "requests", "click", "jinja2", "pygments", "rich", "networkx", "sympy",
                  "attrs", "urllib3", "pyarrow", "fsspec", "packaging", "tqdm", "httpx", "starlette", "aiohttp",
                  "omegaconf", "markdown-it-py", "boto3", "botocore")
HELD_OUT_PACKAGE = "werkzeug"  # the held-out source: none of its code or text is trained on
# Share of each source group in the training prompts (the rest of a short group's share goes unused).
TRAIN_MIX = {"stdlib": 0.25, "python-docs": 0.10, "pkg": 0.35, "pkg-docs": 0.10, "instructions": 0.20}


def unit_hash(unit: str) -> int:
    return int(hashlib.sha256(unit.encode()).hexdigest(), 16)


def is_held_out(unit: str) -> bool:
    """Held out by sample (the by-source hold-out is `held_out_source`)."""
    return unit_hash(unit) % HOLD_OUT_MODULUS == 0


def held_out_source(source: str) -> bool:
    return source.split(":", 1)[-1] == HELD_OUT_PACKAGE and source.startswith(("pkg:", "pkg-docs:"))


def source_group(source: str) -> str:
    return source.split(":", 1)[0]


def python_files(root: Path) -> list[str]:
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & EXCLUDED_DIRS or rel.name.startswith(("_sysconfigdata", "test_")):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def _completion(node, lines: list[str]) -> str | None:
    """The signature, the docstring and the first half of the body: what an editor's completion sees."""
    head_end = node.body[0].end_lineno if ast.get_docstring(node) else node.body[0].lineno - 1
    body = lines[head_end:node.end_lineno]
    if len(body) < 2:
        return None
    return textwrap.dedent("\n".join(lines[node.lineno - 1:head_end] + body[:len(body) // 2]))


def function_prompts(rel: str, text: str, source: str = "stdlib") -> list[tuple[str, str, str, str]]:
    """`(unit, source, kind, prompt)` for the public functions of one source file."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        unit = f"{rel}:{node.name}:{node.lineno}" if source == "stdlib" else f"{source}/{rel}:{node.name}:{node.lineno}"
        doc = ast.get_docstring(node)
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""
        source_text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        n_lines = node.end_lineno - node.lineno + 1
        prompts = {}
        if 4 <= n_lines <= 30 and len(source_text) <= MAX_PROMPT_CHARS:
            prompts["explain"] = f"Explain what this Python function does:\n\n```python\n{source_text}\n```"
        if 20 <= len(summary) <= 300 and not summary.lower().startswith(("deprecated", "internal")):
            prompts["write"] = f"Write a Python function `{node.name}` that does the following: {summary}"
        partial = _completion(node, lines) if 6 <= n_lines <= 40 and len(source_text) <= MAX_PROMPT_CHARS else None
        if partial and source != "stdlib":  # the stdlib's kinds stay those the first draft was trained on
            prompts["complete"] = f"Complete this Python function:\n\n```python\n{partial}\n```"
        if not prompts:
            continue
        kinds = sorted(prompts)
        kind = kinds[unit_hash(unit + "#kind") % len(kinds)]  # not unit_hash(unit): that decides the split
        out.append((unit, source, kind, prompts[kind]))
    return out


def paragraph_prompts(name: str, text: str, *, source: str, where: str) -> list[tuple[str, str, str, str]]:
    out = []
    for i, block in enumerate(b.strip() for b in text.split("\n\n")):
        if 200 <= len(block) <= MAX_PROMPT_CHARS and not block.startswith(("*", "   ", "|", "..", "```", "<")):
            out.append((f"{source}#{name}#{i}", source, "summarize",
                        f"Summarize this passage from {where} in two or three sentences:\n\n{block}"))
    return out


def topic_prompts(topics: dict[str, str]) -> list[tuple[str, str, str, str]]:
    out = []
    for name, text in sorted(topics.items()):
        blocks = [b.strip() for b in text.split("\n\n")]
        title = blocks[0].splitlines()[0].strip() if blocks else name
        out.append((f"topics:{name}", "python-docs", "question",
                    f"In Python, what is {title.strip('*').strip()}? Answer briefly."))
        for i, block in enumerate(blocks[1:], 1):
            if 200 <= len(block) <= MAX_PROMPT_CHARS and not block.startswith(("*", "   ")):
                out.append((f"topics:{name}#{i}", "python-docs", "summarize",
                            f"Summarize this passage from the Python documentation in two or three sentences:\n\n{block}"))
    return out


def package_prompts(name: str) -> list[tuple[str, str, str, str]]:
    """Code and description prompts of one installed distribution ([] when it is not installed)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return []
    out = [(f"pkg-docs:{name}", f"pkg-docs:{name}", "question", f"What is the Python package {name} used for?")]
    out += paragraph_prompts(name, dist.metadata.get_payload() or "", source=f"pkg-docs:{name}",
                             where=f"the documentation of the Python package {name}")
    roots = {Path(dist.locate_file(f.parts[0])) for f in dist.files or ()  # its top-level package directories
             if f.suffix == ".py" and len(f.parts) > 1 and ".dist-info" not in str(f)}
    for root in sorted(roots):
        for rel in python_files(root):
            text = (root / rel).read_text(encoding="utf-8", errors="replace")
            out += function_prompts(f"{root.name}/{rel}", text, source=f"pkg:{name}")
    return out


# Templated general requests: short writing, lists, explanations, arithmetic and rewording, so the draft also
# sees the target's plain prose (the code and documentation sources are all about software).
TOPICS = ("the ocean", "a rainy afternoon", "learning to cook", "city gardens", "the first day at a new job",
          "an old library", "training for a marathon", "a trip to the mountains", "saving money", "friendship",
          "the history of bread", "electric cars", "a lost umbrella", "winter mornings", "volunteering",
          "remote work", "a small bakery", "bird watching", "moving to a new city", "the moon landing")
FORMS = ("a short poem", "a short story", "an email to a colleague", "a product description",
         "the opening paragraph of a blog post", "a haiku", "a short speech")
ACTIVITIES = ("staying focused while studying", "keeping a plant alive", "writing a good resume", "sleeping better",
              "learning a new language", "preparing for a job interview", "reducing stress", "organizing a desk",
              "cooking rice", "running a meeting", "planning a road trip", "reading more books")
CONCEPTS = ("photosynthesis", "inflation", "how a vaccine works", "gravity", "the water cycle", "compound interest",
            "how the internet works", "recursion", "why the sky is blue", "supply and demand", "a database index",
            "climate change", "how a bill becomes law", "machine learning", "the immune system", "encryption")
AUDIENCES = ("a ten-year-old", "a new employee", "a grandparent", "a high-school student", "a busy manager")
SENTENCES = ("we gonna need more time to finish this thing", "the meeting got moved cause the boss is sick",
             "thanks a lot for helping me out yesterday", "this phone is way better than my old one",
             "can you send me the file asap", "the food was ok but the service was super slow",
             "i think we should try a different approach", "the train was late again this morning")
PAIRS = (("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "films"), ("Python", "JavaScript"),
         ("renting", "buying a home"), ("summer", "winter"), ("email", "phone calls"), ("SQL", "NoSQL databases"))


def instruction_prompts() -> list[tuple[str, str, str, str]]:
    requests = [f"Write {form} about {topic}." for form, topic in itertools.product(FORMS, TOPICS)]
    requests += [f"Give {n} practical tips for {a}." for n, a in itertools.product(("three", "five"), ACTIVITIES)]
    requests += [f"Explain {c} to {a}." for c, a in itertools.product(CONCEPTS, AUDIENCES)]
    requests += [f"Rewrite this sentence so it sounds professional: \"{s}\"" for s in SENTENCES]
    requests += [f"Compare {x} and {y} in one short paragraph." for x, y in PAIRS]
    requests += [f"A shop sells pens at {p} dollars each. How much do {n} pens cost? Show your steps."
                 for p, n in itertools.product((2, 3, 4, 7, 12), (5, 8, 11, 15))]
    requests += [f"Describe {t} in three sentences." for t in TOPICS]
    requests += [f"Write a short dialogue between two friends about {t}." for t in TOPICS]
    requests += [f"What are common mistakes people make when {a}?" for a in ACTIVITIES]
    requests += [f"What are the pros and cons of {x} compared with {y}?" for x, y in PAIRS]
    requests += [f"Write a to-do list for {a}." for a in ACTIVITIES]
    requests += [f"Summarize what {c} means in one sentence, then give an example." for c in CONCEPTS]
    requests += [f"Suggest {n} titles for an article about {t}." for n, t in itertools.product(("three", "five"), TOPICS)]
    requests += [f"A train travels {v} km per hour for {h} hours. How far does it go? Explain."
                 for v, h in itertools.product((40, 60, 75, 90, 120), (2, 3, 5))]
    return [(f"instructions:{r}", "instructions", "request", r) for r in requests]


def all_prompts() -> list[tuple[str, str, str, str]]:
    """Every unit of every source: `(unit, source, kind, prompt)`, deterministic."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    units = topic_prompts(topics)
    for rel in python_files(stdlib):
        units += function_prompts(rel, (stdlib / rel).read_text(encoding="utf-8", errors="replace"))
    for name in (*TRAIN_PACKAGES, HELD_OUT_PACKAGE):
        units += package_prompts(name)
    return units + instruction_prompts()


def mixed_sample(units: list, total: int, rng: random.Random) -> list:
    """`total` units in the `TRAIN_MIX` shares; within a group, sources take turns (a big package does not
    crowd out the small ones)."""
    picked = []
    for group, share in TRAIN_MIX.items():
        by_source = {}
        for u in units:
            if source_group(u[1]) == group:
                by_source.setdefault(u[1], []).append(u)
        for rows in by_source.values():
            rng.shuffle(rows)
        turns = [u for round_ in itertools.zip_longest(*(by_source[s] for s in sorted(by_source)))
                 for u in round_ if u is not None]
        picked += turns[:round(share * total)]
    chosen = {u[0] for u in picked}
    rest = [u for u in units if u[0] not in chosen]  # a short group's unused share: any other source's units
    rng.shuffle(rest)
    picked += rest[:max(0, total - len(picked))]
    rng.shuffle(picked)
    return picked


def write_parquet(path: Path, rows: list[tuple[str, str, str, str]], *, messages: bool):
    """Held-out prompts (`messages`) also say how they are held out: `held_out` "source" or "sample"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {"id": pa.array([r[0] for r in rows], pa.string()), "source": pa.array([r[1] for r in rows], pa.string()),
               "kind": pa.array([r[2] for r in rows], pa.string())}
    if messages:
        columns["held_out"] = pa.array(["source" if held_out_source(r[1]) else "sample" for r in rows], pa.string())
        columns["messages"] = pa.array([[{"role": "user", "content": r[3]}] for r in rows],
                                       pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    else:
        columns["prompt"] = pa.array([r[3] for r in rows], pa.string())
    pq.write_table(pa.table(columns), path)


def _counts(rows: list, key) -> dict:
    out = {}
    for r in rows:
        out[key(r)] = out.get(key(r), 0) + 1
    return dict(sorted(out.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("domino_ray/assets/smollm2"), help="held-out prompts + manifest")
    p.add_argument("--work", type=Path, default=Path("work/smollm2"), help="the draft's training prompts")
    p.add_argument("--num-held-out", type=int, default=300, help="held-out prompts, a third of them by source")
    p.add_argument("--num-train", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    units = all_prompts()
    by_source = [u for u in units if held_out_source(u[1])]
    rest = [u for u in units if not held_out_source(u[1])]
    rng = random.Random(args.seed)
    n_source = args.num_held_out // 3
    held = rng.sample(by_source, min(n_source, len(by_source)))
    held += mixed_sample([u for u in rest if is_held_out(u[0])], args.num_held_out - len(held), rng)
    rng.shuffle(held)
    train = mixed_sample([u for u in rest if not is_held_out(u[0])], args.num_train, rng)
    write_parquet(args.out / "prompts.parquet", held, messages=True)
    write_parquet(args.work / "train_prompts.parquet", train, messages=False)
    packages = {n: importlib.metadata.version(n) for n in (*TRAIN_PACKAGES, HELD_OUT_PACKAGE) if _installed(n)}
    manifest = {"python": platform.python_version(), "packages": packages, "held_out_package": HELD_OUT_PACKAGE,
                "sources": "stdlib *.py functions; pydoc_data/topics.py; the code and description of the packages "
                           "above; templated general requests (the `instructions` source)",
                "split_rule": f"held out by source: all of {HELD_OUT_PACKAGE!r} (code and description); by sample: a "
                              f"unit of another source when sha256(unit) % {HOLD_OUT_MODULUS} == 0; held-out units never "
                              f"give training prompts",
                "units": {"total": len(units), "held_out_by_source": len(by_source),
                          "held_out_by_sample": sum(1 for u in rest if is_held_out(u[0]))},
                "held_out_prompts": {"count": len(held), "groups": _counts(held, lambda r: source_group(r[1])),
                                     "kinds": _counts(held, lambda r: r[2])},
                "train_prompts": {"count": len(train), "groups": _counts(train, lambda r: source_group(r[1])),
                                  "kinds": _counts(train, lambda r: r[2])},
                "train_mix": TRAIN_MIX, "seed": args.seed}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
