"""domino-ray: lossless speculative decoding with Domino drafts, batch on Ray Data and online on Ray Serve.

The public Python API is importable from here:

    from domino_ray import DominoLLM, SamplingParams

Each name imports its module on first use (PEP 562), so `import domino_ray` imports neither torch nor Ray, and
only the Ray Data names (`DominoEngineProcessorConfig`, `build_processor`) import Ray. The layers, lowest first:
`backend` (our CPU kernels), `model` (the target as the engine runs it), `spec` (draft, checkpoints, verification,
sampling, the verify width), `engine`, then `llm` (this API) and `training`, and the Ray edges `batch` and `serve`.
"""

from importlib import import_module

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "DominoLLM": "domino_ray.llm",
    "build_engine": "domino_ray.llm",
    "load_target": "domino_ray.model.target",
    "load_tokenizer": "domino_ray.model.target",
    "encode_prompt": "domino_ray.model.target",
    "load_draft": "domino_ray.spec.checkpoint",
    "SamplingParams": "domino_ray.spec.sampling_params",
    "total_stats": "domino_ray.spec.stats",
    "SpecEngine": "domino_ray.engine.spec_engine",
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
