"""Serve the OpenAI-compatible API locally: `python jobs/serve.py [--config FILE] [key=value ...]`.

Without `--config` it serves the CPU demo pair (domino_ray/assets/demo) at http://127.0.0.1:8000/v1
(`serve.host`, `serve.port`) until Ctrl-C or SIGTERM, which remove the apps and stop the Ray processes this
command started (`shutdown_serve`, `ray.shutdown`). `/health` is the load-balancer probe app. With the
environment variable DOMINO_RAY_API_KEY (or `serve.api_key`) set, the /v1 routes require
`Authorization: Bearer <key>`. On a cluster: `serve deploy deploy/serve.yaml`, or the KubeRay manifest
deploy/rayservice.yaml. Exit status: 0 stopped, 2 bad config (nothing started).
"""

from __future__ import annotations

import signal
import sys
import time

from domino_ray.config import ConfigError, config_from_command_line, serve_api_key


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_command_line(argv, __doc__.splitlines()[0], "serve.port=8001")
        # The batch job's model checks (configs, tokenizer, draft shapes; no weights): a model that cannot
        # load fails here, not in a replica that Serve keeps restarting.
        from domino_ray.batch.preflight import check_models

        check_models(cfg)
        keyed = serve_api_key(cfg.serve) is not None  # a bad or conflicting key fails here, before Ray starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from domino_ray.serve.app import build_app, build_health_app, shutdown_serve

    try:
        ray.init(address=cfg.runtime.ray_address)
        # SIGTERM (docker stop, kill, a supervisor) takes the Ctrl-C path, so the finally below runs. Set
        # after ray.init, which installs a C++ SIGTERM handler that aborts the process (exit -6).
        signal.signal(signal.SIGTERM, _interrupt)
        serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
        serve.run(build_app(cfg), name="domino", route_prefix="/")
        serve.run(build_health_app("domino"), name="domino-health", route_prefix="/health")
        print(f"serving {cfg.serve.model_name} at http://{cfg.serve.host}:{cfg.serve.port}/v1"
              f"{' (API key required)' if keyed else ''} (Ctrl-C stops)", flush=True)
        while True:  # the app runs in Ray's processes; this one only holds the session open
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
        try:
            if ray.is_initialized():
                shutdown_serve()  # serve.shutdown() without its false 'graceful_shutdown failed'
        finally:
            ray.shutdown()  # stops the local cluster if this command started one
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
