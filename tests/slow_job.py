"""`python tests/slow_job.py HOLD_S [--config FILE] [key=value ...]`: the batch job of jobs/generate.py with
every row held HOLD_S seconds in its engine actor (tests/faulty_predictor.py), a driver subprocess for
tests that must lose a node while actors hold rows. With SLOW_JOB_PROGRESS_DIR set, each finished batch touches
a file named by its node id there. Exit status: 0 done, 1 the job failed."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from domino_ray.batch.job import run_job
    from domino_ray.config import config_from_command_line
    from faulty_predictor import faulty_predictor

    cfg = config_from_command_line(argv[1:], __doc__.splitlines()[0], "runtime.ray_address=HOST:PORT")
    run_job(cfg, predictor=faulty_predictor(hold_row_s=float(argv[0]),
                                            progress_dir=os.environ.get("SLOW_JOB_PROGRESS_DIR")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
