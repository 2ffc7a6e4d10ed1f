"""Job configuration: one dataclass tree, loaded from YAML and `key=value` overrides by OmegaConf.

The defaults are the CPU demo: the small trained target + Domino draft shipped in
`domino_ray/assets/demo` and its bundled prompts, so `python jobs/generate.py` runs anywhere with no
GPU and no downloads. Production configs (configs/*.yaml) override what differs.

Unknown keys, missing required values (`???`) and bad values fail before any work starts with a
`ConfigError` naming the full key (e.g. `generation.temperature`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from domino_ray.sample.params import SAMPLING_CHECKS, SamplingParams, invalid_value, is_int

DEMO_ASSETS = Path(__file__).parent / "assets" / "demo"
API_KEY_ENV = "DOMINO_RAY_API_KEY"  # Serve's API key from the environment (e.g. a Kubernetes Secret)
KEY_RULE = "a non-empty string of visible ASCII characters (no spaces)"
REDACTED = "<redacted>"


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    source: str = str(DEMO_ASSETS / "target")  # target: local directory or hub id (e.g. Qwen/Qwen3-4B)
    tokenizer: str | None = None      # tokenizer source when it differs from `source`
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16; auto: the checkpoint's, but on CPU a
                                      # 16-bit one runs in float32 unless the CPU has AVX512_BF16 or AMX (bfloat16)
    device: str = "auto"              # auto (cuda when available) | cpu | cuda | cuda:N
    max_model_len: int | None = None  # prompt + generated tokens per row; None = the model's limit
    chat_template: bool = False       # wrap plain prompts as one user turn (true for chat models)
    enable_thinking: bool = False     # Qwen3 chat template switch
    # Special-token strings ("<|im_end|>") in prompt and message text encode as plain text unless true
    # (true: the old behaviour, for prompts already rendered with a chat template); Serve and batch alike.
    parse_special_tokens: bool = False


@dataclass
class DraftSection:
    source: str | None = str(DEMO_ASSETS / "draft")  # draft: local directory or hub id; null = target only
    # auto = adaptive: each step verifies W = 0..K drafts, K the most the checkpoint supports (docs/engine.md
    # "Verify width"); an int = a fixed K; null = a fixed K at the checkpoint's most
    num_draft_tokens: Any = "auto"


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128         # per row, unless a row overrides it
    temperature: float = 0.0          # 0 = greedy; at most 2 (sampling_params.MAX_TEMPERATURE)
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int = 0                     # the one seed, for sampled rows without their own: a batch row gets one
                                      # from (seed, id) (independent of batching), the engine's generator this
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first (vLLM's rule)
    include_stop_str_in_output: bool = False
    n: int = 1                        # output rows per input row (sample_index 0..n-1)
    logprobs: Any = None              # null, or N in [0, 20]: each generated token's logprob and the top N
    presence_penalty: float = 0.0     # [-2, 2], OpenAI's definition, over generated tokens
    frequency_penalty: float = 0.0    # [-2, 2], OpenAI's definition, over generated tokens
    repetition_penalty: float = 1.0   # (0, 2], HF/vLLM's definition, over prompt and generated tokens
    min_tokens: int = 0               # EOS and stop ids suppressed until this many tokens
    max_batch_size: Any = 16          # a cap on rows in flight (decoding or being prefilled; continuous batching);
                                      # "auto" = what the KV pool and the step's activations allow
    max_prefill_tokens: int = 8192    # prompt tokens prefilled per step: a longer prompt is prefilled in chunks,
                                      # interleaved with the decode steps
    kv_block_size: int = 16           # positions per block of the paged KV cache: a power of two >= 8
    kv_cache_tokens: Any = "auto"     # the KV pool in tokens, shared by the rows in flight; "auto" = what the memory
                                      # left after the rest of the engine holds (runtime.gpu_memory_utilization)


@dataclass
class S3Config:
    endpoint_url: str | None = None   # e.g. http://127.0.0.1:9000 for MinIO; null = AWS
    region: str | None = None
    anonymous: bool = False
    # Credentials come from the standard AWS environment (AWS_ACCESS_KEY_ID, profiles, instance roles).


@dataclass
class InputConfig:
    path: str = str(DEMO_ASSETS / "prompts.parquet")  # file, directory of shards or glob; local or s3://
    prompt_column: str = "prompt"     # plain-text prompts
    messages_column: str = "messages"  # chat prompts: list of {role, content}
    id_column: str = "id"             # generated deterministically when absent
    sampling_column: str = "sampling_params"  # optional per-row overrides: struct or JSON object
    limit: int | None = None          # read at most this many rows (smoke runs)
    s3: S3Config = field(default_factory=S3Config)


@dataclass
class OutputConfig:
    path: str = "out/demo"            # directory, local or s3://; also the job's checkpoint (resume)
    min_rows_per_file: int | None = None  # Parquet file sizing: bigger files, more rows redone after a crash
    max_rows_per_file: int | None = None
    allow_mixed_settings: bool = False  # resume into an output whose rows were made with other settings
    s3: S3Config = field(default_factory=S3Config)


@dataclass
class RuntimeConfig:
    ray_address: str | None = None    # null = start or join a local cluster (ray.init())
    min_actors: int = 1               # ActorPoolStrategy min_size
    max_actors: int = 1               # ActorPoolStrategy max_size
    gpus_per_actor: float | None = None  # null = 1 when the cluster has GPUs, else 0
    accelerator_type: str | None = None  # engine actors only on this GPU type (Ray's, e.g. H100); null = any
    accelerator_resource: str | None = None  # custom resource marking engine nodes: 1 per actor/replica; null = GPUs only
    cpus_per_actor: float = 1.0
    batch_size: int = 64              # rows per map_batches call
    max_concurrent_batches: int = 4   # batches in flight per actor; their rows share the engine's slots
    seed: int | None = None           # deprecated alias of generation.seed (a warning; both given: an error)
    compare_baseline: bool = False    # also run the rows target-only and report the speed-up (small jobs)
    cuda_graphs: str = "auto"         # auto (on for CUDA devices) | on | off: capture the engine's steps
    gpu_memory_utilization: float = 0.9  # share of the device memory free after the weights the engine may take


@dataclass
class ServeAutoscaling:
    max_replicas: int | None = None   # null = a fixed serve.num_replicas; set to autoscale
    min_replicas: int = 1
    target_ongoing_requests: float = 16.0  # per replica; near generation.max_batch_size keeps slots full


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"           # 0.0.0.0 to listen on every interface
    port: int = 8000
    model_name: str = "domino-demo"   # the id clients send as `model` (GET /v1/models lists it)
    num_replicas: int = 1             # one engine per replica
    autoscaling: ServeAutoscaling = field(default_factory=ServeAutoscaling)
    gpus_per_replica: float | None = None  # null = 1 when the cluster has GPUs, else 0
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 64    # per replica: HTTP requests inside it (running or waiting for a slot)
    max_waiting_requests: int = 48    # per replica: requests waiting for an engine slot; beyond -> 429 at once
    # (max_ongoing_requests <= generation.max_batch_size + max_waiting_requests leaves the choice to
    # Serve's router, which balances replicas; the engine queue is then only a backstop)
    max_queued_requests: int = 128    # per proxy, waiting for a replica; beyond -> 429 at once (-1 = no limit)
    max_request_bytes: int = 1048576  # request body limit (1 MiB); beyond -> 413 before any parsing
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    # Required as `Authorization: Bearer <key>` on /v1/... when set; null = open. Prefer the environment
    # variable DOMINO_RAY_API_KEY (API_KEY_ENV) to keep it out of YAML files; both set and different is an error.
    api_key: str | None = field(default=None, repr=False)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftSection = field(default_factory=DraftSection)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def config_from_command_line(argv: list[str] | None, description: str, example: str) -> JobConfig:
    """`[--config FILE] [key=value ...]`, the command line of jobs/generate.py and jobs/serve.py."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config (default: the built-in CPU demo config)")
    parser.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Defaults <- YAML file <- `key=value` overrides, checked; raises ConfigError naming the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged, required, file_cfg = OmegaConf.structured(JobConfig), set(), None
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            file_cfg = OmegaConf.load(path)
            # Merging `???` over a default keeps the default, so the file's required keys are tracked here.
            required = OmegaConf.missing_keys(file_cfg)
            merged = OmegaConf.merge(merged, file_cfg)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        cli = OmegaConf.from_dotlist(list(overrides))
        unset = sorted(required - {k for k in required if OmegaConf.select(cli, k) is not None})
        if unset:
            raise ConfigError(f"config key {unset[0]} is required by {path} (give it as {unset[0]}=...)")
        merged = OmegaConf.merge(merged, cli)
        cfg = OmegaConf.to_object(merged)
        seed_given = any(OmegaConf.select(c, "generation.seed", default=None) is not None
                         for c in (file_cfg, cli) if c is not None)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        reason = str(exc).splitlines()[0]  # OmegaConf appends reference/object types on further lines
        raise ConfigError(f"config key {key}: {reason}" if key else f"bad config: {reason}") from None
    fold_deprecated_seed(cfg, generation_seed_given=seed_given)
    # YAML reads a bare on/off as a boolean, which the str field then holds as "True"/"False".
    cfg.runtime.cuda_graphs = {"True": "on", "False": "off"}.get(cfg.runtime.cuda_graphs, cfg.runtime.cuda_graphs)
    validate(cfg)
    return cfg


def fold_deprecated_seed(cfg: JobConfig, *, generation_seed_given: bool = False):
    """`runtime.seed` (the engine's seed, once a second seed) now means `generation.seed`: move it there
    with a warning; giving both with different values is an error, not a silent pick."""
    old = cfg.runtime.seed
    if old is None:
        return
    import warnings

    if generation_seed_given and cfg.generation.seed != old:
        raise ConfigError(f"config key runtime.seed={old!r} is a deprecated alias of generation.seed, which is "
                          f"{cfg.generation.seed!r}: give only generation.seed")
    warnings.warn("config key runtime.seed is deprecated: it is folded into generation.seed (set that instead)",
                  FutureWarning, stacklevel=3)
    cfg.generation.seed, cfg.runtime.seed = old, None


def validate(cfg: JobConfig):
    """Value checks OmegaConf's types cannot express."""
    g, r, s, o = cfg.generation, cfg.runtime, cfg.serve, cfg.output
    rules: list[tuple[str, Any, bool, str]] = [
        (f"generation.{name}", getattr(g, name), ok(getattr(g, name)), expected)
        for name, (ok, expected) in SAMPLING_CHECKS.items() if name != "seed"]
    seed_ok = SAMPLING_CHECKS["seed"][0](g.seed) and g.seed is not None  # the job's seed cannot be null
    rules += [
        ("generation.seed", g.seed, seed_ok, "an int in [0, 2**63)"),
        ("generation.min_tokens", g.min_tokens, not is_int(g.min_tokens) or g.min_tokens <= g.max_new_tokens,
         "an int <= generation.max_new_tokens"),
        ("model.dtype", cfg.model.dtype, cfg.model.dtype in ("auto", "float32", "bfloat16", "float16", "float64"),
         "auto, float32, bfloat16, float16 or float64"),
        ("model.max_model_len", cfg.model.max_model_len,
         cfg.model.max_model_len is None or (is_int(cfg.model.max_model_len) and cfg.model.max_model_len > 1),
         "null or an int > 1"),
        ("draft.num_draft_tokens", cfg.draft.num_draft_tokens,
         cfg.draft.num_draft_tokens in (None, "auto")
         or (is_int(cfg.draft.num_draft_tokens) and cfg.draft.num_draft_tokens >= 1),
         "auto, null or an int >= 1"),
        ("generation.max_batch_size", g.max_batch_size,
         g.max_batch_size == "auto" or (is_int(g.max_batch_size) and g.max_batch_size >= 1), "auto or an int >= 1"),
        ("generation.max_prefill_tokens", g.max_prefill_tokens,
         is_int(g.max_prefill_tokens) and g.max_prefill_tokens >= 1, "an int >= 1"),
        ("generation.kv_block_size", g.kv_block_size,
         is_int(g.kv_block_size) and g.kv_block_size >= 8 and g.kv_block_size & (g.kv_block_size - 1) == 0,
         "a power of two >= 8"),
        ("generation.kv_cache_tokens", g.kv_cache_tokens,
         g.kv_cache_tokens == "auto" or (is_int(g.kv_cache_tokens) and g.kv_cache_tokens >= 1), "auto or an int >= 1"),
        ("runtime.min_actors", r.min_actors, r.min_actors >= 1, "an int >= 1"),
        ("runtime.max_actors", r.max_actors, r.max_actors >= r.min_actors, "an int >= runtime.min_actors"),
        ("runtime.cpus_per_actor", r.cpus_per_actor, r.cpus_per_actor > 0, "a number > 0"),
        ("runtime.gpus_per_actor", r.gpus_per_actor, r.gpus_per_actor is None or r.gpus_per_actor >= 0,
         "null or a number >= 0"),
        ("runtime.accelerator_resource", r.accelerator_resource,
         r.accelerator_resource is None or (r.accelerator_resource.strip() != "" and r.accelerator_resource
                                            not in ("CPU", "GPU", "memory", "object_store_memory")),
         "null or a custom resource name (CPU and GPU have their own keys)"),
        ("runtime.batch_size", r.batch_size, r.batch_size >= 1, "an int >= 1"),
        ("runtime.cuda_graphs", r.cuda_graphs, r.cuda_graphs in ("auto", "on", "off"), "auto, on or off"),
        ("runtime.gpu_memory_utilization", r.gpu_memory_utilization, 0 < r.gpu_memory_utilization <= 1,
         "a number in (0, 1]"),
        ("runtime.max_concurrent_batches", r.max_concurrent_batches, r.max_concurrent_batches >= 1, "an int >= 1"),
        ("output.min_rows_per_file", o.min_rows_per_file, o.min_rows_per_file is None or o.min_rows_per_file >= 1,
         "null or an int >= 1"),
        ("output.max_rows_per_file", o.max_rows_per_file,
         o.max_rows_per_file is None or o.max_rows_per_file >= max(1, o.min_rows_per_file or 1),
         "null or an int >= max(1, output.min_rows_per_file)"),
    ]
    for key, value, ok, expected in rules + _serve_rules(s):
        if not ok:
            raise ConfigError("config key " + invalid_value(key, value, expected))
    _check_api_key(s)
    for key, value in (("model.source", cfg.model.source), ("input.path", cfg.input.path),
                       ("output.path", cfg.output.path), ("serve.model_name", s.model_name)):
        if not str(value).strip():
            raise ConfigError(f"config key {key} is empty")


def _serve_rules(s: ServeConfig) -> list[tuple[str, Any, bool, str]]:
    """`validate`'s checks of the serve section."""
    return [
        ("serve.port", s.port, 0 < s.port < 65536, "a port number"),
        ("serve.num_replicas", s.num_replicas, s.num_replicas >= 1, "an int >= 1"),
        ("serve.max_ongoing_requests", s.max_ongoing_requests, s.max_ongoing_requests >= 1, "an int >= 1"),
        ("serve.max_waiting_requests", s.max_waiting_requests, s.max_waiting_requests >= 0, "an int >= 0"),
        ("serve.max_queued_requests", s.max_queued_requests, s.max_queued_requests >= -1, "-1 (no limit) or an int >= 0"),
        ("serve.max_request_bytes", s.max_request_bytes, s.max_request_bytes >= 1024, "an int >= 1024"),
        ("serve.cpus_per_replica", s.cpus_per_replica, s.cpus_per_replica > 0, "a number > 0"),
        ("serve.gpus_per_replica", s.gpus_per_replica, s.gpus_per_replica is None or s.gpus_per_replica >= 0,
         "null or a number >= 0"),
        ("serve.autoscaling.min_replicas", s.autoscaling.min_replicas, s.autoscaling.min_replicas >= 0, "an int >= 0"),
        ("serve.autoscaling.max_replicas", s.autoscaling.max_replicas,
         s.autoscaling.max_replicas is None or s.autoscaling.max_replicas >= max(1, s.autoscaling.min_replicas),
         "null or an int >= max(1, serve.autoscaling.min_replicas)"),
        ("serve.autoscaling.target_ongoing_requests", s.autoscaling.target_ongoing_requests,
         s.autoscaling.target_ongoing_requests > 0, "a number > 0"),
        ("serve.health_check_period_s", s.health_check_period_s, s.health_check_period_s > 0, "a number > 0"),
        ("serve.health_check_timeout_s", s.health_check_timeout_s, s.health_check_timeout_s > 0, "a number > 0"),
    ]


def _check_api_key(s: ServeConfig):
    """serve.api_key's check, apart from `_serve_rules`: its message must not print the value."""
    if s.api_key is not None and not _key_ok(s.api_key):
        raise ConfigError(f"config key serve.api_key is invalid: expected null or {KEY_RULE}")


def to_dict(cfg: JobConfig) -> dict:
    """Plain dict of a config (for _summary.json and logs); the API key redacted."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if d["serve"]["api_key"] is not None:
        d["serve"]["api_key"] = REDACTED
    return d


def serve_api_key(s: ServeConfig, environ=None) -> str | None:
    """The key Serve requires: `serve.api_key` or the environment's DOMINO_RAY_API_KEY (read where the
    replica runs); both set and different is an error, as a silent pick would leave one of them unenforced.
    No message shows the key itself."""
    env = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if env is not None and not _key_ok(env):
        raise ConfigError(f"environment variable {API_KEY_ENV} is invalid: expected {KEY_RULE}")
    if env is not None and s.api_key is not None and env != s.api_key:
        raise ConfigError(f"config key serve.api_key and environment variable {API_KEY_ENV} are both set and "
                          "differ: give only one")
    return env if env is not None else s.api_key


def _key_ok(key) -> bool:
    return isinstance(key, str) and key != "" and all("!" <= c <= "~" for c in key)


def generation_defaults(g: GenerationConfig) -> SamplingParams:
    """The parameters of a batch row or Serve request that sets none of its own: the config's
    `generation` section. No seed: a sampled batch row derives its own from `generation.seed` and its
    id (schema.row_params), a request brings one or takes the engine's generator."""
    return SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                          top_k=g.top_k, stop_token_ids=tuple(g.stop_token_ids), ignore_eos=g.ignore_eos,
                          stop=tuple(g.stop), include_stop_str_in_output=g.include_stop_str_in_output, n=g.n,
                          logprobs=g.logprobs, presence_penalty=g.presence_penalty,
                          frequency_penalty=g.frequency_penalty, repetition_penalty=g.repetition_penalty,
                          min_tokens=g.min_tokens)
