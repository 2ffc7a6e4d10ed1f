import json
import re

import pytest

from domino_ray.config import ConfigError, JobConfig, load_config, validate
from domino_ray.sample.params import MAX_TEMPERATURE, SamplingParams


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  source: /models/t\ngeneration:\n  max_new_tokens: 64\n")
    cfg = load_config(path, ["generation.temperature=0.5", "draft.source=null"])
    assert (cfg.model.source, cfg.generation.max_new_tokens, cfg.generation.temperature) == ("/models/t", 64, 0.5)
    assert cfg.draft.source is None
    assert load_config().generation.temperature == 0.0


@pytest.mark.parametrize("override,message", [
    ("generation.temprature=1", "generation.temprature"),
    ("generation.temperature=hot", "generation.temperature"),
    ("generation.top_p=2", r"generation.top_p=2.0 is invalid"),
    ("runtime.max_actors=0", "runtime.max_actors"),
    ("runtime.accelerator_resource=GPU", "runtime.accelerator_resource='GPU' is invalid"),
    ("serve.port=70000", "serve.port"),
    ("model.dtype=int8", "model.dtype"),
    ("nonsense", "key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_required_value_names_the_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  source: ???\n")
    with pytest.raises(ConfigError, match="model.source"):
        load_config(path)
    assert load_config(path, ["model.source=/models/t"]).model.source == "/models/t"


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")


# (field, bad value): every SamplingParams field, bools where numbers are expected included.
BAD_SAMPLING = [("max_new_tokens", 0), ("max_new_tokens", True), ("temperature", -1.0), ("temperature", True),
                ("top_p", 0.0), ("top_k", -2), ("top_k", False), ("seed", True), ("seed", -1),
                ("stop_token_ids", [True]), ("stop_token_ids", [-1]), ("ignore_eos", 1)]


@pytest.mark.parametrize("name,value", BAD_SAMPLING)
def test_sampling_params_and_config_reject_the_same_values_alike(name, value):
    """One set of checks: SamplingParams and config.validate refuse the same values with the same
    message, the config's naming the full key."""
    with pytest.raises(ValueError) as sampling_error:
        SamplingParams(**{name: value})
    cfg = JobConfig()
    setattr(cfg.generation, name, value)
    with pytest.raises(ConfigError) as config_error:
        validate(cfg)
    sampling_message, config_message = str(sampling_error.value), str(config_error.value)
    assert sampling_message.startswith(f"sampling parameter {name}=")
    assert config_message.startswith(f"config key generation.{name}={value!r} is invalid: expected ")
    # The same expectation, except that the job's seed is never null (a request's may be).
    expected = sampling_message.split(" is invalid: expected ", 1)[1]
    assert config_message.split(" is invalid: expected ", 1)[1] == expected.removeprefix("null or ")


@pytest.mark.parametrize("temperature,accepted", [(MAX_TEMPERATURE, True), (0.0, True), (2.01, False),
                                                   (100.0, False), (-0.5, False)])
def test_one_temperature_range_for_config_sampling_params_and_serve(temperature, accepted):
    """The config, SamplingParams and a Serve request accept and refuse the same temperatures."""
    from domino_ray.serve.openai_api import APIError, ModelSpec, parse_request

    cfg = JobConfig()
    cfg.generation.temperature = temperature
    model = ModelSpec(name="m", tokenizer=None, vocab_size=10, max_model_len=8)  # token-id prompts: no tokenizer
    request = json.dumps({"prompt": [1, 2], "temperature": temperature}).encode()
    if accepted:
        validate(cfg)
        assert SamplingParams(temperature=temperature).temperature == temperature
        assert parse_request("completion", request, model).params.temperature == temperature
        return
    expected = f"temperature={temperature!r} is invalid: expected a number in [0, 2]"
    with pytest.raises(ConfigError, match=re.escape("generation." + expected)):
        validate(cfg)
    with pytest.raises(ValueError, match=re.escape(expected)):
        SamplingParams(temperature=temperature)
    with pytest.raises(APIError) as refused:
        parse_request("completion", request, model)
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, "temperature", expected)


def test_one_seed_runtime_seed_is_a_deprecated_alias():
    assert load_config().generation.seed == 0
    with pytest.warns(FutureWarning, match="runtime.seed is deprecated"):
        cfg = load_config(None, ["runtime.seed=5"])
    assert (cfg.generation.seed, cfg.runtime.seed) == (5, None)
    with pytest.raises(ConfigError, match="runtime.seed=5 is a deprecated alias of generation.seed"):
        load_config(None, ["runtime.seed=5", "generation.seed=7"])
    with pytest.raises(ConfigError, match="generation.seed"):
        load_config(None, ["generation.seed=null"])


def test_cuda_graphs_setting_reaches_the_engine_settings():
    from domino_ray.llm import engine_settings

    for value in ("off", "on", "auto"):
        cfg = load_config(None, [f"runtime.cuda_graphs={value}"])
        assert engine_settings(cfg.model, cfg.draft, cfg.generation, cfg.runtime)["cuda_graphs"] == value
    with pytest.raises(ConfigError, match=r"runtime\.cuda_graphs"):
        load_config(None, ["runtime.cuda_graphs=sometimes"])


@pytest.mark.parametrize("override,expected", [
    ("generation.kv_block_size=12", "a power of two >= 8"), ("generation.kv_block_size=4", "a power of two >= 8"),
    ("generation.kv_block_size=0", "a power of two >= 8"),
    ("generation.kv_cache_tokens=0", "auto or an int >= 1"), ("generation.kv_cache_tokens=lots", "auto or an int >= 1"),
    ("generation.kv_cache_tokens=1.5", "auto or an int >= 1"),
])
def test_bad_kv_cache_settings_name_the_key(override, expected):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=re.escape(f"config key {key}=") + ".* is invalid: expected " + expected):
        load_config(None, [override])


def test_kv_cache_settings_reach_the_engine_settings():
    """Defaults (16, auto) and given values reach `build_engine`'s settings, and neither is an output setting (the
    output rows do not depend on them: a resume with another pool size is not refused)."""
    from domino_ray.batch.preflight import output_settings
    from domino_ray.llm import engine_settings

    for overrides, block, tokens in (([], 16, "auto"), (["generation.kv_block_size=32",
                                                          "generation.kv_cache_tokens=4096"], 32, 4096)):
        cfg = load_config(None, overrides)
        settings = engine_settings(cfg.model, cfg.draft, cfg.generation, cfg.runtime)
        assert (settings["kv_block_size"], settings["kv_cache_tokens"]) == (block, tokens)
        assert not {"generation.kv_block_size", "generation.kv_cache_tokens"} & set(output_settings(cfg))
    assert load_config(None, ["generation.kv_block_size=8"]).generation.kv_block_size == 8
