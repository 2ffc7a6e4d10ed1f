"""Domino inside your own Ray Data pipeline: JSONL in, the processor, a post-processing step, Parquet out.

    .venv/bin/python examples/ray_data_pipeline.py                      # the demo pair on this CPU
    .venv/bin/python examples/ray_data_pipeline.py --model Qwen/Qwen3-4B --draft Huang2020/Qwen3-4B-Domino-b16 \
        --input s3://bucket/snippets/ --output s3://bucket/completions/ --chat

Without arguments it completes the 24 code snippets in examples/snippets.jsonl with the demo target and
its Domino draft (domino_ray/assets/demo) and writes out/example/. Any Ray Data source and sink work the same.
"""

from __future__ import annotations

import argparse

import ray

from domino_ray.batch.processor import DominoEngineProcessorConfig, build_processor
from domino_ray.config import DEMO_ASSETS


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default="examples/snippets.jsonl", help="JSONL with `name` and `code` fields")
    parser.add_argument("--output", default="out/example")
    parser.add_argument("--model", default=str(DEMO_ASSETS / "target"))
    parser.add_argument("--draft", default=str(DEMO_ASSETS / "draft"))
    parser.add_argument("--chat", action="store_true", help="ask a chat model to complete the code")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    config = DominoEngineProcessorConfig(
        model_source=args.model, draft_source=args.draft,
        engine_kwargs={"num_draft_tokens": "auto", "max_batch_size": 16, "cpus_per_actor": 1},
        batch_size=8, concurrency=1, max_concurrent_batches=2, chat_template_stage=args.chat)

    def preprocess(row: dict) -> dict:
        if args.chat:
            prompt = {"messages": [{"role": "user", "content": f"Complete this Python code:\n{row['code']}"}]}
        else:
            prompt = {"prompt": row["code"]}
        return dict(name=row["name"], **prompt, sampling_params=dict(temperature=0.0, max_tokens=args.max_tokens))

    def postprocess(row: dict) -> dict:
        return dict(name=row["name"], completion=row["generated_text"], tokens=row["num_generated_tokens"],
                    tokens_per_step=row["mean_acceptance_length"], error=row["error"])

    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    # Reading JSONL is light: a quarter CPU leaves the rest to the engine on a small machine.
    ds = processor(ray.data.read_json(args.input, num_cpus=0.25))
    ds.write_parquet(args.output, mode="overwrite")  # a rerun replaces the earlier results

    done = ray.data.read_parquet(args.output).to_pandas()
    ok = done[done["error"].isna()]
    print(f"{len(done)} rows -> {args.output} ({len(done) - len(ok)} failed); "
          f"{ok['tokens'].sum()} tokens, {ok['tokens_per_step'].mean():.2f} tokens per target step on average")
    print(f"first: {done.iloc[0]['name']}: {done.iloc[0]['completion'][:120]!r}")


if __name__ == "__main__":
    main()
