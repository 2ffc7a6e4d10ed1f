"""Deployment wiring without a cluster: the `serve:` section becomes Serve options; deploy/serve.yaml and
the RayService's serveConfigV2 are valid Serve configs whose import path builds the app; the local start
refuses a bad config before starting anything."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from domino_ray.config import ConfigError, load_config
from domino_ray.serve.app import app_builder, deployment_options, health_app_builder

ROOT = Path(__file__).resolve().parent.parent


def test_serve_section_becomes_deployment_options():
    cfg = load_config(None, ["serve.num_replicas=3", "serve.gpus_per_replica=1", "serve.cpus_per_replica=2",
                             "serve.max_ongoing_requests=96", "serve.max_queued_requests=7",
                             "serve.health_check_period_s=5"])
    opts = deployment_options(cfg)
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert (opts["max_ongoing_requests"], opts["max_queued_requests"], opts["health_check_period_s"]) == (96, 7, 5.0)
    assert opts["backpressure_config"].status_code == 429  # same status as a full engine queue

    auto = deployment_options(load_config(None, ["serve.autoscaling.max_replicas=4",
                                                 "serve.autoscaling.min_replicas=2"]))
    assert "num_replicas" not in auto
    a = auto["autoscaling_config"]
    assert (a.min_replicas, a.max_replicas, a.initial_replicas, a.target_ongoing_requests) == (2, 4, 2, 16.0)
    assert auto["ray_actor_options"]["num_gpus"] == 0  # null = 1 only when the cluster has GPUs

    # One key places engines for the batch job and Serve alike: a custom resource marking engine nodes.
    pinned = deployment_options(load_config(None, ["runtime.accelerator_resource=engine_slot"]))
    assert pinned["ray_actor_options"]["resources"] == {"engine_slot": 1}


def test_bad_serve_keys_are_named():
    for override, key in [("serve.max_waiting_requests=-1", "serve.max_waiting_requests"),
                          ("serve.autoscaling.max_replicas=0", "serve.autoscaling.max_replicas"),
                          ("serve.port=70000", "serve.port"), ("serve.cpus_per_replica=0", "serve.cpus_per_replica"),
                          ("serve.replicas=2", "serve.replicas")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])


def serve_configs():
    service = yaml.safe_load((ROOT / "deploy/rayservice.yaml").read_text())
    return [yaml.safe_load((ROOT / "deploy/serve.yaml").read_text()), yaml.safe_load(service["spec"]["serveConfigV2"])]


@pytest.mark.parametrize("which", [0, 1], ids=["serve.yaml", "rayservice.yaml"])
def test_deploy_files_are_valid_serve_configs_that_build_the_app(which):
    raw = serve_configs()[which]
    schema = ServeDeploySchema.model_validate(raw)
    app, health = schema.applications
    assert (health.route_prefix, health.import_path) == ("/health", "domino_ray.serve.app:health_app_builder")
    assert dict(health.args)["app_name"] == app.name
    assert health_app_builder(dict(health.args))._bound_deployment.name == "HealthProbe"
    assert app.import_path == "domino_ray.serve.app:app_builder"
    args = dict(app.args)
    # The production config file lives in the image; build against the defaults with the same overrides.
    overrides = args.get("overrides") or []
    for item in overrides:
        load_config(None, [item])  # every override names a real key with a valid value
    built = app_builder({"config": None, "overrides": overrides})
    deployment = built._bound_deployment
    assert deployment.name == "DominoServer"
    cfg = load_config(None, overrides)
    assert deployment.max_ongoing_requests == cfg.serve.max_ongoing_requests


def test_app_builder_rejects_unknown_args():
    with pytest.raises(ValueError, match="unknown application args"):
        app_builder({"config": None, "replicas": 2})


def test_local_start_refuses_a_bad_config_before_starting_ray(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_job", ROOT / "jobs/serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main(["generation.temperature=-1"]) == 2
    assert "generation.temperature" in capsys.readouterr().err
    assert job.main([f"model.source={tmp_path}/missing"]) == 2
    assert "model.source" in capsys.readouterr().err
    assert job.main([f"draft.source={tmp_path}"]) == 2  # a directory without a draft checkpoint
    assert "draft.source" in capsys.readouterr().err
    assert job.main(["--config", str(tmp_path / "none.yaml")]) == 2
