"""JSON extraction on the SmolLM2 pair (issue 52): tokens/s of target-only unconstrained, target-only constrained to a
six-field schema, and Domino auto constrained (forced tokens as drafts), side by side in one run.

    python benchmarks/bench_structured.py --prompts 32 --batch-sizes 1,16 --repeats 2

Prompts: chat requests to extract a person's record from a sentence built from fixed lists (no data set needed).
Each mode runs the same prompts at each batch size, in interleaved repeats (the machine is noisy); tokens/s is the
median over repeats. Checks, untimed: every finished constrained output validates against the schema, and Domino's
tokens equal target-only's constrained ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from domino_ray.frontend.requests import prompt_requests
from domino_ray.llm import build_engine
from domino_ray.sample.params import SamplingParams
from domino_ray.spec_decode.stats import total_stats
from domino_ray.target.loading import encode_prompt

from common import load_pair, run_meta

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "occupation", "email", "member"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 30}, "occupation": {"type": "string", "maxLength": 30},
                         "email": {"type": "string", "maxLength": 50}, "member": {"type": "boolean"}}}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Linus Pauling", "Marie Curie", "Niels Bohr", "Rosalind Franklin",
         "Katherine Johnson"]
CITIES = ["London", "Paris", "Berlin", "Lisbon", "Toronto", "Kyoto", "Nairobi", "Lima"]
JOBS = ["engineer", "teacher", "nurse", "chemist", "pilot", "librarian", "baker", "architect"]


def extraction_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        name, city, job = NAMES[i % 8], CITIES[(i * 3) % 8], JOBS[(i * 5) % 8]
        member = "is" if i % 2 else "is not"
        sentence = (f"{name}, aged {21 + (i * 7) % 50}, works as a {job} in {city}; write to "
                    f"{name.split()[0].lower()}{i}@example.org. She {member} a club member.")
        out.append(f"Extract the person's record from this text as JSON with the fields name, age, city, occupation, "
                   f"email and member.\n\n{sentence}")
    return out


MODES = {"target-only": (False, False), "target-only constrained": (False, True), "auto constrained": (True, True)}


def run(engine, tokenizer, prompts, max_new_tokens: int, constrained: bool) -> dict:
    params = SamplingParams(max_new_tokens=max_new_tokens,
                            structured_outputs={"json": SCHEMA} if constrained else None)
    requests = [r for i, ids in enumerate(prompts) for r in prompt_requests(
        i, ids, params, tokenizer=tokenizer, max_model_len=engine.max_model_len,
        eos_token_ids=sorted(engine.eos_token_ids))]
    start = time.perf_counter()
    out = engine.generate(requests)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out), "token_ids": [c.token_ids for c in out],
            "texts": [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out],
            "finished": [c.finish_reason == "stop" for c in out],
            "tau": total_stats(c.stats for c in out).mean_acceptance_length}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--one-row-prompts", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import jsonschema

    pair = load_pair("smollm2", num_prompts=1, dtype=args.dtype)
    prompts = [encode_prompt(pair.tokenizer, messages=[{"role": "user", "content": t}])
               for t in extraction_prompts(args.prompts)]
    max_model_len = max(map(len, prompts)) + args.max_new_tokens
    results = {"meta": run_meta(args), "rows": []}
    for rows in [int(b) for b in args.batch_sizes.split(",")]:
        work = prompts[:args.one_row_prompts] if rows == 1 else prompts
        engines = {name: build_engine(pair.target, pair.draft if draft else None, pair.tokenizer, max_batch_size=rows,
                                      max_model_len=max_model_len, num_draft_tokens="auto")
                   for name, (draft, _) in MODES.items()}
        runs = {name: [] for name in MODES}
        for repeat in range(args.repeats):
            order = list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]
            for name in order:
                runs[name].append(run(engines[name], pair.tokenizer, work, args.max_new_tokens, MODES[name][1]))
        first = {name: r[0] for name, r in runs.items()}
        assert first["auto constrained"]["token_ids"] == first["target-only constrained"]["token_ids"]
        valid = 0
        for text, done in zip(first["auto constrained"]["texts"], first["auto constrained"]["finished"]):
            if done:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid += 1
        rate = {name: statistics.median(x["tokens"] / x["seconds"] for x in r) for name, r in runs.items()}
        row = {"rows": rows, "prompts": len(work), "tokens_per_s": rate, "valid_json": valid,
               "tau_auto": first["auto constrained"]["tau"],
               "constrained_over_plain": rate["target-only constrained"] / rate["target-only"],
               "auto_over_target_only_constrained": rate["auto constrained"] / rate["target-only constrained"]}
        results["rows"].append(row)
        print(f"{rows} row(s), {len(work)} prompts: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in rate.items())
              + f"; constrained / plain {row['constrained_over_plain']:.2f}x, auto / target-only constrained "
                f"{row['auto_over_target_only_constrained']:.2f}x (tau {row['tau_auto']:.2f}); "
                f"{valid}/{len(work)} finished and valid", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
