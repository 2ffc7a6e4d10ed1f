"""Batch generation on Ray Data: `python jobs/generate.py [--config configs/x.yaml] [key=value ...]`.

Without `--config` the defaults run the CPU demo (domino_ray/assets/demo). On a cluster:
`ray job submit -- python jobs/generate.py --config configs/qwen3_4b.yaml input.path=s3://...`.
Rerunning the same command resumes an interrupted job; on a finished job it is a no-op.
Exit status: 0 done, 2 bad config or inputs (nothing ran), 1 the job failed.
"""

from __future__ import annotations

import argparse
import sys

from domino_ray.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the built-in CPU demo config)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. generation.max_new_tokens=64")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from domino_ray.ray_batch import run_job

        run_job(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
