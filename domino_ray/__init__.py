"""domino-ray: lossless speculative decoding with Domino drafts, batch on Ray Data and online on Ray Serve.

The public Python API is importable from here:

    from domino_ray import DominoLLM, SamplingParams

Each name imports its module on first use (PEP 562), so `import domino_ray` imports neither torch nor Ray, and
only the Ray Data names (`DominoEngineProcessorConfig`, `build_processor`) import Ray. The layers, lowest first:
`backend` (our CPU kernels), `kv` (the block pool, the KV pools, attention over them), `target` (the target as the
engine runs it), `spec_decode` (draft, checkpoints, verification, the verify width, statistics), `sample` (sampling
parameters, sampling, penalties), `engine`, `frontend` (prompts and parameters to requests, completions to text),
then `llm` (this API), `training` and `config`, and the Ray edges `batch` and `serve`.
"""

from importlib import import_module

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "DominoLLM": "domino_ray.llm",
    "build_engine": "domino_ray.llm",
    "load_target": "domino_ray.target.loading",
    "load_tokenizer": "domino_ray.target.loading",
    "encode_prompt": "domino_ray.target.loading",
    "load_draft": "domino_ray.spec_decode.checkpoint",
    "SamplingParams": "domino_ray.sample.params",
    "total_stats": "domino_ray.spec_decode.stats",
    "SpecEngine": "domino_ray.engine.core",
    "Request": "domino_ray.engine.request",
    "DominoEngineProcessorConfig": "domino_ray.batch.processor",
    "build_processor": "domino_ray.batch.processor",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'domino_ray' has no attribute {name!r}")
    return getattr(import_module(_API[name]), name)


def __dir__():
    return sorted([*globals(), *_API])
