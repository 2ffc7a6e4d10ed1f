import pytest

from domino_ray.config import ConfigError, load_config


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
