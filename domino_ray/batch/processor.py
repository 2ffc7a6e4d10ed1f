"""Domino as a Ray Data stage, shaped like Ray Data LLM's processors (docs/ray-data.md).

    from domino_ray import DominoEngineProcessorConfig, build_processor

    config = DominoEngineProcessorConfig(model_source="Qwen/Qwen3-4B", draft_source="Huang2020/Qwen3-4B-Domino-b16",
                                         engine_kwargs={"dtype": "bfloat16", "max_batch_size": "auto"},
                                         batch_size=64, concurrency=4)
    processor = build_processor(config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["question"]}],
                                    sampling_params=dict(temperature=0.0, max_tokens=512)),
        postprocess=lambda row: dict(answer=row["generated_text"], **row))
    ds = processor(ray.data.read_json("s3://bucket/questions/"))   # lazy, like any Ray Data transform

The stages, each one output row per input row:

    preprocess (map) -> tokenize_batch (CPU tasks) -> DominoPredictor (engine actors: the GPU)
                     -> detokenize_batch (CPU tasks) -> postprocess (map)

Rows carry `prompt` or `messages` and optional `sampling_params` (ours or Ray Data LLM's key names) and
leave with every column they came with plus schema.GENERATED_FIELDS and `prompt_token_ids`. A bad row
becomes an error row (reason in `error`, typed defaults elsewhere) unless `should_continue_on_error`
is false; postprocess sees error rows too, so every output row has one schema.

Ray's own `ray.data.llm.build_processor(config)` also builds ours: a config registers `build_processor`
in Ray's `ProcessorBuilder` (ray.llm._internal.batch.processor.base), which dispatches on the config's
class name and passes preprocess/postprocess and their map kwargs as keyword arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import ray

from domino_ray.batch.predictor import DominoPredictor
from domino_ray.batch.text_stages import detokenize_batch, tokenize_batch
from domino_ray.config import ConfigError, JobConfig, RuntimeConfig, load_config

# engine_kwargs may set keys of these config sections, as `section.key` or a bare `key` that names one.
ENGINE_SECTIONS = ("model", "draft", "generation", "runtime", "input")
# ...except what the processor config has its own field for.
OWN_FIELDS = {"model.source": "model_source", "draft.source": "draft_source", "runtime.batch_size": "batch_size",
              "runtime.min_actors": "concurrency", "runtime.max_actors": "concurrency",
              "runtime.max_concurrent_batches": "max_concurrent_batches",
              "runtime.accelerator_type": "accelerator_type", "model.chat_template": "chat_template_stage"}


# CPUs reserved per actor or task of the light stages (text, pre/postprocess, the job's reads). Ray's
# default of 1 would starve a small machine: with the engine's CPU taken, a 1-CPU task never starts.
LIGHT_CPUS = 0.25


def light_concurrency(r: RuntimeConfig) -> int:
    """Tasks at once of a light stage (the job's reads and writes, tokenize, detokenize): one per engine actor the
    pool may hold. Each task's worker process imports the tokenizer's stack (~5 s of CPU); on a small machine more of
    them than engines only take CPU from the engines: the tests' tiny job took 45-49 s of machine CPU at one, 71-80 s
    unbounded (AMD EPYC, 2 cores, AVX2)."""
    return r.max_actors


@dataclass
class StageResources:
    """A CPU stage's tasks: `tokenize_stage` / `detokenize_stage` given as a dict."""
    batch_size: int | None = None     # rows per call; None = the processor's batch_size
    concurrency: int | None = None    # tasks at once at most; None = one per engine actor (`light_concurrency`)
    num_cpus: float = LIGHT_CPUS      # per task; tokenizing is light next to generating


@dataclass
class DominoEngineProcessorConfig:
    """Ray Data LLM's `vLLMEngineProcessorConfig` fields where the concept is the same; ours where not."""
    model_source: str                        # the target: local directory or hub id
    draft_source: str | None = None          # the Domino draft; None = target only
    engine_kwargs: dict = field(default_factory=dict)  # our config keys, e.g. {"num_draft_tokens": "auto",
                                             # "dtype": "bfloat16", "max_batch_size": "auto", "max_model_len": 8192}
    batch_size: int = 64                     # rows per engine call
    concurrency: int | tuple = 1             # engine actors: n (fixed) or (min, max) (autoscaling)
    max_concurrent_batches: int = 4          # batches in flight per engine actor; their rows share its slots
    accelerator_type: str | None = None      # e.g. "H100" (Ray's accelerator_type); None = any GPU
    should_continue_on_error: bool = True    # ours: true (error rows); false = the run fails naming the row
    error_column: str = "error"              # "__inference_error__" for Ray Data LLM's name
    chat_template_stage: bool = True         # plain `prompt`s become one user turn; `messages` always use it
    tokenize_stage: bool | dict = True       # True or StageResources fields as a dict
    detokenize_stage: bool | dict = True     # False: no `generated_text` (tokens only)
    runtime_env: dict | None = None          # for the engine actors

    def __post_init__(self):
        self.tokenize = _stage("tokenize_stage", self.tokenize_stage, allow_off=False)
        self.detokenize = _stage("detokenize_stage", self.detokenize_stage, allow_off=True)  # None: no text
        if not isinstance(self.chat_template_stage, bool):
            raise ConfigError(f"chat_template_stage={self.chat_template_stage!r}: expected true or false (the chat "
                              "template and the tokenizer run as one stage: give its resources in tokenize_stage)")
        if self.error_column not in ("error", "__inference_error__"):
            raise ConfigError(f"error_column={self.error_column!r}: expected 'error' or '__inference_error__'")
        self.cfg = self.job_config()  # fails now, naming the key, rather than inside a Ray actor later
        _register_with_ray_data_llm()

    def job_config(self) -> JobConfig:
        low, high = _pool("concurrency", self.concurrency)
        values = {"model.source": self.model_source, "draft.source": self.draft_source,
                  "runtime.batch_size": self.batch_size, "runtime.min_actors": low, "runtime.max_actors": high,
                  "runtime.max_concurrent_batches": self.max_concurrent_batches,
                  "runtime.accelerator_type": self.accelerator_type, "model.chat_template": self.chat_template_stage}
        given: dict[str, str] = {}
        for key, value in self.engine_kwargs.items():
            full = _config_key(key)
            if full in OWN_FIELDS:
                raise ConfigError(f"engine_kwargs[{key!r}]: set it with the processor config's "
                                  f"{OWN_FIELDS[full]} instead")
            if full in given:
                raise ConfigError(f"engine_kwargs gives {full} twice (as {given[full]!r} and {key!r})")
            given[full], values[full] = key, value
        return load_config(None, [f"{k}={json.dumps(v)}" for k, v in values.items()])


def build_processor(config: DominoEngineProcessorConfig, preprocess: Callable | None = None,
                    postprocess: Callable | None = None, preprocess_map_kwargs: dict | None = None,
                    postprocess_map_kwargs: dict | None = None) -> "Processor":
    """Ray Data LLM's `build_processor`: a Dataset -> Dataset processor around our engine."""
    return Processor(config.cfg, preprocess=preprocess, postprocess=postprocess,
                     preprocess_map_kwargs=preprocess_map_kwargs or {},
                     postprocess_map_kwargs=postprocess_map_kwargs or {}, tokenize=config.tokenize,
                     detokenize=config.detokenize,
                     continue_on_error=config.should_continue_on_error, error_column=config.error_column,
                     runtime_env=config.runtime_env)


@dataclass
class Processor:
    """Dataset -> Dataset (lazily). The batch job builds one from its JobConfig with its own extras:
    `use_draft` (False for the target-only comparison), `stats_sink` (its RunStats actor), `predictor` (a
    DominoPredictor subclass in the fault tests) and `schema` (the explicit output schema of its files)."""
    cfg: JobConfig
    preprocess: Callable | None = None
    postprocess: Callable | None = None
    preprocess_map_kwargs: dict = field(default_factory=dict)
    postprocess_map_kwargs: dict = field(default_factory=dict)
    tokenize: StageResources = field(default_factory=StageResources)
    detokenize: StageResources | None = field(default_factory=StageResources)  # None: no generated_text
    continue_on_error: bool = True
    error_column: str = "error"
    runtime_env: dict | None = None
    use_draft: bool = True
    stats_sink: Any = None
    predictor: type = DominoPredictor
    schema: pa.Schema | None = None

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg, r = self.cfg, self.cfg.runtime
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, **{"num_cpus": LIGHT_CPUS, **self.preprocess_map_kwargs})
        ds = ds.map_batches(tokenize_batch, fn_args=(cfg,), **self._cpu_stage(self.tokenize))
        ds = ds.map_batches(
            self.predictor, batch_size=r.batch_size, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(min_size=r.min_actors, max_size=r.max_actors,
                                               max_concurrent_calls_per_actor=r.max_concurrent_batches),
            runtime_env=self.runtime_env, fn_constructor_args=(cfg,),
            fn_constructor_kwargs={"use_draft": self.use_draft, "stats_sink": self.stats_sink}, **engine_resources(r))
        ds = ds.map_batches(detokenize_batch, fn_args=(cfg,),
                            fn_kwargs={"detokenize": self.detokenize is not None,
                                       "continue_on_error": self.continue_on_error,
                                       "error_column": self.error_column, "schema": self.schema},
                            **self._cpu_stage(self.detokenize or StageResources()))
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, **{"num_cpus": LIGHT_CPUS, **self.postprocess_map_kwargs})
        return ds

    def _cpu_stage(self, stage: StageResources) -> dict:
        return {"batch_size": stage.batch_size or self.cfg.runtime.batch_size, "batch_format": "pyarrow",
                "num_cpus": stage.num_cpus, "concurrency": stage.concurrency or light_concurrency(self.cfg.runtime)}


def engine_resources(r: RuntimeConfig) -> dict:
    """Ray resource options of one engine (an actor of the engine stage, or a task that runs one): its CPUs, a GPU when
    the cluster has GPUs (unless `gpus_per_actor` says), the accelerator type and the custom resource when set."""
    gpus = r.gpus_per_actor if r.gpus_per_actor is not None else (1 if ray.cluster_resources().get("GPU") else 0)
    options = {"num_cpus": r.cpus_per_actor, "num_gpus": gpus or None}
    if r.accelerator_type:
        options["accelerator_type"] = r.accelerator_type
    if r.accelerator_resource:  # engines only on nodes that offer it (custom resource per engine)
        options["resources"] = {r.accelerator_resource: 1}
    return options


def _pool(name: str, concurrency) -> tuple[int, int]:
    """(min, max) actors from n or (min, max)."""
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return concurrency, concurrency
    if (isinstance(concurrency, (tuple, list)) and len(concurrency) == 2
            and all(isinstance(c, int) and not isinstance(c, bool) for c in concurrency)
            and 1 <= concurrency[0] <= concurrency[1]):
        return concurrency[0], concurrency[1]
    raise ConfigError(f"{name}={concurrency!r}: expected an int >= 1 or (min, max) with 1 <= min <= max")


def _stage(name: str, value, *, allow_off: bool) -> StageResources | None:
    if value is True:
        return StageResources()
    if value is False and allow_off:
        return None
    if isinstance(value, dict):
        known = set(StageResources.__dataclass_fields__)
        if set(value) - known:
            raise ConfigError(f"{name} has unknown keys {sorted(set(value) - known)}; allowed: {sorted(known)}")
        stage = StageResources(**value)
        if stage.concurrency is not None and not (isinstance(stage.concurrency, int) and stage.concurrency >= 1):
            raise ConfigError(f"{name}.concurrency={stage.concurrency!r}: expected null or an int >= 1 (tasks at once)")
        if not (isinstance(stage.num_cpus, (int, float)) and stage.num_cpus >= 0):
            raise ConfigError(f"{name}.num_cpus={stage.num_cpus!r}: expected a number >= 0")
        return stage
    expected = "true, false or a dict" if allow_off else "true or a dict (tokenizing runs as its own CPU stage)"
    raise ConfigError(f"{name}={value!r}: expected {expected} of {sorted(StageResources.__dataclass_fields__)}")


def _config_key(key: str) -> str:
    """`section.key`, or the one section holding a bare `key`."""
    from dataclasses import fields

    if "." in key:
        return key
    sections = [s for s in ENGINE_SECTIONS if f"{s}.{key}" != "runtime.seed"  # deprecated: generation.seed
                and key in {f.name for f in fields(JobConfig.__dataclass_fields__[s].default_factory)}]
    if len(sections) == 1:
        return f"{sections[0]}.{key}"
    where = f"it is in {sections}" if sections else f"no section of {list(ENGINE_SECTIONS)} has it"
    raise ConfigError(f"engine_kwargs[{key!r}]: give it as section.key ({where})")


def _register_with_ray_data_llm():
    """Make `ray.data.llm.build_processor(DominoEngineProcessorConfig(...))` build ours. Relies on Ray's
    internal `ProcessorBuilder.register(config_type, builder)` (keyed by the class name) and on its
    `build` calling `builder(config, preprocess=..., postprocess=..., preprocess_map_kwargs=...,
    postprocess_map_kwargs=...)`; without them only our own build_processor works."""
    try:
        from ray.llm._internal.batch.processor.base import ProcessorBuilder
    except ImportError:
        return
    try:
        ProcessorBuilder.register(DominoEngineProcessorConfig, build_processor)
    except ValueError:  # registered by an earlier config
        pass
