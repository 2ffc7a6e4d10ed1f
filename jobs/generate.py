"""Batch generation on Ray Data: `python jobs/generate.py [--config configs/x.yaml] [key=value ...]`.

Without `--config` the defaults run the CPU demo (domino_ray/assets/demo). On a cluster:
`ray job submit -- python jobs/generate.py --config configs/qwen3_4b.yaml input.path=s3://...`.
Rerunning the same command resumes an interrupted job; on a finished job it is a no-op.
Exit status: 0 done, 2 bad config or inputs (nothing ran), 1 the job failed.
"""

from __future__ import annotations

import sys

from domino_ray.config import ConfigError, config_from_command_line


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_command_line(argv, __doc__.splitlines()[0], "generation.max_new_tokens=64")
        from domino_ray.batch.job import run_job
        from domino_ray.batch.predictor import RowCrashesEngine

        try:
            run_job(cfg)
        except RowCrashesEngine as exc:  # the job failed, but for a reason that fits in one line
            print(f"error: {exc}", file=sys.stderr)
            return 1
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
