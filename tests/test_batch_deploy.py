"""Production configs and deploy files: they load, name what is missing, and agree with each other."""

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from batch_fixtures import REPO
from domino_ray.config import ConfigError, load_config

PATHS = ["input.path=s3://bucket/prompts/", "output.path=s3://bucket/out/"]


@pytest.mark.parametrize("name, target, draft", [("qwen3_4b", "Qwen/Qwen3-4B", "Huang2020/Qwen3-4B-Domino-b16"),
                                                 ("qwen3_0_6b", "Qwen/Qwen3-0.6B", "Eros483/Qwen3-0.6B-Domino-b8")])
def test_production_configs(name, target, draft):
    path = REPO / "configs" / f"{name}.yaml"
    with pytest.raises(ConfigError, match="config key input.path is required"):
        load_config(path)
    with pytest.raises(ConfigError, match="config key output.path is required"):
        load_config(path, PATHS[:1])
    cfg = load_config(path, PATHS)
    assert (cfg.model.source, cfg.draft.source, cfg.model.dtype) == (target, draft, "bfloat16")
    assert cfg.model.chat_template and not cfg.model.enable_thinking and cfg.runtime.gpus_per_actor == 1


def test_cluster_launcher_yaml_matches_rays_schema():
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cluster = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    worker = cluster["available_node_types"]["gpu_worker"]
    assert worker["max_workers"] == load_config(REPO / "configs" / "qwen3_4b.yaml", PATHS).runtime.max_actors


def _entrypoint_config(words):
    assert words[:2] == ["python", "jobs/generate.py"], words
    config = words[words.index("--config") + 1]
    return load_config(REPO / config, [w for w in words[words.index("--config") + 2:]])


def test_rayjob_manifest():
    job = yaml.safe_load((REPO / "deploy" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    cfg = _entrypoint_config(shlex.split(job["spec"]["entrypoint"]))
    assert cfg.input.path.startswith("s3://") and cfg.output.path.startswith("s3://")
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["pip"] == yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text())["pip"]
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"


def test_runtime_env_pins_match_the_project():
    pyproject = (REPO / "pyproject.toml").read_text()
    for pin in yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text())["pip"]:
        if "==" in pin:
            assert f'"{pin}"' in pyproject, pin


def test_submit_script():
    script = REPO / "deploy" / "submit.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "set RAY_ADDRESS" in run.stderr  # and it ran nothing
    # The script itself is exercised end to end against a local cluster in test_batch_cli.py.
