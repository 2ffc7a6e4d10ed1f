"""Deployment wiring without a cluster: the `serve:` section becomes Serve options; deploy/serve.yaml and
the RayService's serveConfigV2 are valid Serve configs whose import path builds the app; the local start
refuses a bad config before starting anything; the app's ASGI middleware turns Serve's cancelled receive into
a disconnect."""

import asyncio
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from domino_ray.config import API_KEY_ENV, ConfigError, load_config, serve_api_key, to_dict
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


def test_api_key_from_config_or_environment_never_shown():
    """serve.api_key or DOMINO_RAY_API_KEY (the one Serve then requires); both set and different is an error, not
    a silent pick; the key is in no repr, no to_dict (what _summary.json and logs get) and no error message.
    Fails if the environment silently wins over a different config key: checked by dropping the conflict check
    in `serve_api_key`."""
    key = "sk-secret-4d2e"
    cfg = load_config(None, [f"serve.api_key={key}"])
    assert serve_api_key(cfg.serve, {}) == key == serve_api_key(cfg.serve, {API_KEY_ENV: key})
    assert serve_api_key(load_config().serve, {API_KEY_ENV: key}) == key
    assert serve_api_key(load_config().serve, {}) is None  # no key: the routes stay open
    assert to_dict(cfg)["serve"]["api_key"] == "<redacted>" and to_dict(load_config())["serve"]["api_key"] is None
    assert key not in repr(cfg) and key not in str(to_dict(cfg))
    errors = []
    for attempt in (lambda: serve_api_key(cfg.serve, {API_KEY_ENV: key + "2"}),
                    lambda: serve_api_key(load_config().serve, {API_KEY_ENV: ""}),
                    lambda: serve_api_key(load_config().serve, {API_KEY_ENV: f"{key} x"}),
                    lambda: load_config(None, [f"serve.api_key={key} x"])):
        with pytest.raises(ConfigError) as info:
            attempt()
        errors.append(str(info.value))
    assert "both set and differ" in errors[0] and all(API_KEY_ENV in e for e in errors[1:3])
    assert all("serve.api_key" in e for e in errors[3:]) and not any(key in e for e in errors), errors


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


def test_rayservice_passes_the_api_key_from_a_secret_to_every_ray_container():
    """Replicas read DOMINO_RAY_API_KEY where they run: every group's Ray container gets it from the Secret, and
    the manifest itself holds no key (no plain `value`). Fails if a group lacks it: checked by removing the
    worker group's env."""
    cluster = yaml.safe_load((ROOT / "deploy/rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        [container] = group["template"]["spec"]["containers"]
        [var] = [v for v in container.get("env", []) if v["name"] == "DOMINO_RAY_API_KEY"]
        assert set(var) == {"name", "valueFrom"}
        assert var["valueFrom"]["secretKeyRef"] == {"name": "domino-serve-api-key", "key": "api-key"}


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


def test_a_cancelled_receive_ends_a_stream_as_a_disconnect():
    """When a client leaves, Serve cancels the Ray task a replica reads the request's messages with, and the next
    `receive()` raises TaskCancelledError in place of returning `http.disconnect`. Behind
    `DisconnectOnCancelledReceive` (on `api`) a streaming response ends as on a disconnect; without it the error
    failed the request after Serve had stopped waiting on it, and asyncio logged a 60-line "Future exception was
    never retrieved" in the replica for some of the clients (whether it does is a race inside Serve, so
    `test_serve.py::test_client_disconnect_frees_its_slot` can only watch the log).
    Fails without the middleware: checked by removing `api.add_middleware(DisconnectOnCancelledReceive)` (not on
    `api`), and its `except TaskCancelledError` (the stream raised it)."""
    from ray.exceptions import TaskCancelledError
    from starlette.responses import StreamingResponse

    from domino_ray.serve.app import DisconnectOnCancelledReceive, api

    assert [m.cls for m in api.user_middleware] == [DisconnectOnCancelledReceive]

    async def endless():
        while True:
            yield "data: {}\n\n"
            await asyncio.sleep(0.01)

    async def receive():
        await asyncio.sleep(0.05)  # the stream is under way when the client leaves
        raise TaskCancelledError()

    sent = []

    async def send(message):
        sent.append(message)

    # ASGI 2.3, as Serve's replica passes it: Starlette's stream then watches `receive()` for the disconnect.
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/v1/completions",
             "headers": []}
    app = DisconnectOnCancelledReceive(StreamingResponse(endless(), media_type="text/event-stream"))
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    assert sent[0]["type"] == "http.response.start" and len(sent) > 2
