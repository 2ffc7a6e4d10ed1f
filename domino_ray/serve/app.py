"""Ray Serve edge: one speculative engine per replica behind an OpenAI-compatible HTTP API.

    serve run deploy/serve.yaml              # or: python jobs/serve.py [--config FILE] [key=value ...]

Each replica loads the target (+ Domino draft) once and runs it on an `EngineLoop` thread; every HTTP
request submits one engine request per choice (`n`) and awaits their streams, so concurrent requests share
the running batch (continuous batching) and tokens stream back as they are committed. A client that goes
away cancels its handler, which aborts its engine requests and frees their slots. Request parsing lives in
the Ray-free `openai_api`, response bodies in `responses`, the request's n choices streamed in `choices`,
the counters in `metrics`; this module is FastAPI + Serve.

With an API key (`serve.api_key` or DOMINO_RAY_API_KEY, `config.serve_api_key`) the /v1 routes require
`Authorization: Bearer <key>`, compared in constant time before the body is read: a missing or wrong key is an
OpenAI-shaped 401 that costs no engine work. `/health` and `/load` stay open. FastAPI's /docs, /redoc and
/openapi.json are off: they would be open beside a key, and describe nothing the OpenAI API's own reference does not.

Overload is answered at once, never by unbounded waiting: beyond `serve.max_waiting_requests` waiting
for an engine slot the replica answers 429 (EngineLoop QueueFull); beyond `serve.max_ongoing_requests`
per replica, requests queue at the proxy up to `serve.max_queued_requests`, then Serve's proxy answers
429 itself (a plain-text body Serve 2.60 does not let an app shape; docs/serving.md "Overload").

Every request the replica sees shares its queue, `/health` too, so load balancers probe the `HealthProbe`
app (`build_health_app`, route `/health`): a replica-free deployment that reads Serve's own view of the
engine replicas (kept current by `check_health`), and so answers under any load. The replica's
`/load` (and, without the probe app, `/health`) reports its engine's running and waiting requests.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations as real types.
import asyncio
import dataclasses
import hmac
import logging
import time
import uuid

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError, TaskCancelledError
from ray.serve.config import AutoscalingConfig, BackpressureConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from domino_ray.config import JobConfig, generation_defaults, load_config, serve_api_key
from domino_ray.engine.loop import EngineLoop
from domino_ray.llm import load_engine
from domino_ray.serve.metrics import Metrics
from domino_ray.serve.openai_api import APIError, ModelSpec, ParsedRequest, parse_request
from domino_ray.serve.responses import (SSE_DONE, chunk_body, logprobs_body, models_body, response_body, sse,
                                        usage_chunk_body)
from domino_ray.serve.choices import Piece, generate

logger = logging.getLogger("ray.serve")
api = FastAPI(title="domino-ray", description="OpenAI-compatible speculative decoding (target + Domino draft)",
              docs_url=None, redoc_url=None, openapi_url=None)


class DisconnectOnCancelledReceive:
    """ASGI middleware: a `receive()` that raises TaskCancelledError is the client's `http.disconnect`.

    A replica reads a request's messages from the proxy with a Ray task (Serve's `ASGIReceiveProxy`); when the
    client leaves, Serve cancels the request and that task with it, and the next `receive()` raises instead of
    returning the disconnect. A streaming response (Starlette's `listen_for_disconnect`) then fails the request
    with it after Serve stopped waiting on the request, and asyncio logs "Future exception was never retrieved"
    with a 60-line traceback for an ordinary disconnect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


api.add_middleware(DisconnectOnCancelledReceive)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds `limit` bytes (before any parsing)."""
    too_large = APIError(413, f"request body exceeds {limit} bytes (config serve.max_request_bytes)",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _internal_error(exc: BaseException) -> APIError:
    logger.exception("request failed")
    return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error", code="internal_error")


def _error(exc: APIError) -> JSONResponse:
    headers = {429: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def check_api_key(request: Request, key: bytes | None):
    """Raises a 401 unless the request carries `Authorization: Bearer <key>` (no key configured: open)."""
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise APIError(401, "missing API key: send it as the header 'Authorization: Bearer <key>' (the openai "
                            "client's api_key)", code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode(), key):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes and wrong methods answer with an OpenAI-style body too."""
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


@serve.deployment
@serve.ingress(api)
class DominoServer:
    def __init__(self, cfg: JobConfig):
        key = serve_api_key(cfg.serve)  # again where the replica runs: a different key in its environment is an error
        self.api_key = key.encode() if key is not None else None
        engine, self.tokenizer = load_engine(cfg.model, cfg.draft, cfg.generation, cfg.runtime)
        if engine.slot_report:
            logger.info("replica engine: %s", engine.slot_report)
        self.loop = EngineLoop(engine, max_waiting=cfg.serve.max_waiting_requests)
        self.model = ModelSpec(
            name=cfg.serve.model_name, tokenizer=self.tokenizer, vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len, enable_thinking=cfg.model.enable_thinking,
            parse_special_tokens=cfg.model.parse_special_tokens, defaults=generation_defaults(cfg.generation),
            eos_token_ids=tuple(engine.eos_token_ids), max_n=engine.max_rows + cfg.serve.max_waiting_requests)
        self.created = int(time.time())  # the model card's (`/v1/models`); a response has its own
        self.metrics = Metrics(cfg.serve.model_name, engine.kv_cache_stats)
        self.max_request_bytes = cfg.serve.max_request_bytes

    def check_health(self):
        """Serve calls this periodically; raising marks the replica unhealthy and Serve replaces it."""
        if not self.loop.alive:
            raise RuntimeError(f"engine loop is not running: {self.loop.error!r}")

    def __del__(self):  # Serve calls this when it stops the replica
        if hasattr(self, "loop"):
            self.loop.stop(timeout=1.0)

    @api.get("/health")
    @api.get("/load")
    async def health(self):
        if not self.loop.alive:
            return JSONResponse({"status": "dead", "error": repr(self.loop.error)}, status_code=503)
        # Read without the engine thread's cooperation: a monitoring snapshot, possibly one step stale.
        return {"status": "ok", "running": len(self.loop.engine.rows), "waiting": self.loop.num_waiting()}

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            check_api_key(request, self.api_key)
        except APIError as exc:
            return _error(exc)
        return models_body(self.model, self.created)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._respond(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._respond(request, "chat")

    async def _respond(self, request: Request, kind: str):
        started, route, created = time.perf_counter(), kind, int(time.time())
        try:
            check_api_key(request, self.api_key)  # before the body is read: a stranger costs nothing
            raw = await read_body(request, self.max_request_bytes)
            # JSON and tokenization off the event loop: a big prompt must not stall /health or other streams.
            parsed = await asyncio.to_thread(parse_request, kind, raw, self.model)
            response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
            pieces = generate(self.loop, response_id, parsed, self.model)
            first = await anext(pieces)  # errors before the first token still get a proper status
        except APIError as exc:
            self.metrics.ended(route, str(exc.status))
            return _error(exc)
        except Exception as exc:
            error = _internal_error(exc)
            self.metrics.ended(route, str(error.status))
            return _error(error)
        self.metrics.ttft.observe(time.perf_counter() - started)
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, response_id, created, first, pieces, started, route),
                                     media_type="text/event-stream")
        n = parsed.params.n
        texts, latest, status = [[] for _ in range(n)], {}, "cancelled"  # stays so if the client goes away
        try:
            piece = first
            while True:
                texts[piece.index].append(piece.text)
                latest[piece.index] = piece
                if len(latest) == n and all(p.completion is not None for p in latest.values()):
                    break
                piece = await anext(pieces)
            status = "200"
            finals = [latest[i] for i in range(n)]
            return response_body(parsed, response_id, created, self.model, ["".join(t) for t in texts],
                                 [p.finish_reason for p in finals], [p.completion for p in finals])
        except APIError as exc:
            status = str(exc.status)
            return _error(exc)
        except Exception as exc:
            error = _internal_error(exc)
            status = str(error.status)
            return _error(error)
        finally:
            await pieces.aclose()  # aborts the engine requests unless they finished (e.g. the client left)
            self.metrics.ended(route, status, list(latest.values()), started)

    async def _stream(self, parsed: ParsedRequest, response_id: str, created: int, first: Piece, pieces,
                      started: float, route: str):
        """Server-sent events: a chunk per piece that has text or log-probabilities (a choice's first always,
        naming the chat role), a finishing chunk per choice; the last carries usage and statistics (or, with
        include_usage, one more chunk without choices)."""
        head = (response_id, created, self.model.name)  # every chunk of the response: one id, one time
        n, latest, begun, offsets = parsed.params.n, {}, set(), {}
        status, piece = "cancelled", first  # stays "cancelled" if the client goes away mid-stream
        try:
            while True:
                i = piece.index
                latest[i] = piece
                if i not in begun or piece.text or piece.logprobs:
                    logprobs = logprobs_body(parsed.kind, self.tokenizer, piece.logprobs, offsets.get(i, 0))
                    if logprobs is not None and parsed.kind == "completion" and logprobs["tokens"]:
                        offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    yield sse(chunk_body(parsed, *head, i, piece.text, first=i not in begun, logprobs=logprobs))
                    begun.add(i)
                if piece.completion is not None:
                    done = len(latest) == n and all(p.completion is not None for p in latest.values())
                    completions = [latest[c].completion for c in range(n)] if done else None
                    yield sse(chunk_body(parsed, *head, i, "", finish_reason=piece.finish_reason,
                                         completions=None if parsed.include_usage else completions))
                    if done:
                        break
                piece = await anext(pieces)
            if parsed.include_usage:  # as OpenAI: the finishing chunks, then one with usage and no choices
                yield sse(usage_chunk_body(parsed, *head, completions))
            yield SSE_DONE
            status = "200"
        except Exception as exc:  # headers are sent: report in the stream, as OpenAI does
            error = exc if isinstance(exc, APIError) else _internal_error(exc)
            status = str(error.status)
            yield sse(error.body())
            yield SSE_DONE
        finally:
            await pieces.aclose()  # aborts the engine requests unless they finished
            self.metrics.ended(route, status, list(latest.values()), started)


def deployment_options(cfg: JobConfig) -> dict:
    """Serve deployment options from the `serve:` section."""
    s = cfg.serve
    gpus = s.gpus_per_replica
    if gpus is None:  # 1 per replica when the cluster has GPUs, else CPU
        gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0
    actor = {"num_cpus": s.cpus_per_replica, "num_gpus": gpus}
    if cfg.runtime.accelerator_resource:  # as the batch job's engine actors: only on nodes that offer it
        actor["resources"] = {cfg.runtime.accelerator_resource: 1}
    options = dict(
        ray_actor_options=actor,
        max_ongoing_requests=s.max_ongoing_requests, max_queued_requests=s.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        health_check_period_s=s.health_check_period_s, health_check_timeout_s=s.health_check_timeout_s,
    )
    a = s.autoscaling
    if a.max_replicas is None:
        options["num_replicas"] = s.num_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas, max_replicas=a.max_replicas, target_ongoing_requests=a.target_ongoing_requests,
            initial_replicas=max(a.min_replicas, 1))
    return options


def build_app(cfg: JobConfig) -> serve.Application:
    """The engine app. An API key from this process's environment travels with the config (in the replicas'
    constructor arguments, never a log or runtime_env), so replicas on nodes without the variable enforce it too."""
    key = serve_api_key(cfg.serve)
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, api_key=key))
    return DominoServer.options(**deployment_options(cfg)).bind(cfg)


def shutdown_serve(timeout_s: float = 30.0):
    """`serve.shutdown()` without its false alarm. Serve's (`ServeControllerClient.shutdown`) waits on the
    controller's `graceful_shutdown`, which only ends when the controller, having removed the apps and proxies,
    kills itself; the controller is created with `max_task_retries=-1` (`default_impl.get_controller_impl`), so
    Ray reports the waiting call to the driver as a failed task it will retry ("Task
    ServeController.graceful_shutdown failed ... killed by `ray.kill`") at every clean stop. The same steps, that
    call not retried, end in the RayActorError Serve expects there. Serve's private client: recheck on upgrades."""
    from ray.serve.context import _disconnect, _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    client.shutdown_cached_handles()
    try:
        ray.get(client._controller.graceful_shutdown.options(max_task_retries=0).remote(), timeout=timeout_s)
    except RayActorError:
        pass  # the controller removed the apps and proxies, then itself
    except GetTimeoutError:
        logger.warning("Serve's controller did not shut down within %s s; see its log", timeout_s)
    _disconnect()


# Ray's implicit resource of the head node (1 there, absent elsewhere): a sliver of it pins an actor there.
HEAD_NODE = {"node:__internal_head__": 0.001}


@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE}, max_ongoing_requests=1000,
                  max_queued_requests=-1)
class HealthProbe:
    """`GET /health` for load balancers: 200 while the engine app has a running replica, else 503.

    It never touches an engine replica (whose queue it would wait in): it asks the Serve controller,
    which health-checks the replicas itself (`DominoServer.check_health`) and replaces failed ones.
    It runs on the head node, beside the controller: on a worker node (Serve spreads replicas) it would go down
    with that node, and /health would time out while its replacement starts."""

    def __init__(self, app_name: str):
        self.app_name = app_name

    async def __call__(self, request: Request):
        status = await asyncio.to_thread(serve.status)  # a blocking call to the controller
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(DominoServer.name) if app is not None else None
        running = deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0
        body = {"status": "ok" if running else "unavailable", "application": getattr(app.status, "value", app.status) if app else None,
                "running_replicas": running}
        return JSONResponse(body, status_code=200 if running else 503)


def build_health_app(app_name: str = "domino") -> serve.Application:
    """The load-balancer probe for the engine app named `app_name`; run it at route_prefix "/health"."""
    return HealthProbe.bind(app_name)


def health_app_builder(args: dict) -> serve.Application:
    """`serve run` / `serve deploy` entry for the probe: args `{app_name: the engine app's name}`."""
    unknown = set(args) - {"app_name"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected app_name")
    return build_health_app(args.get("app_name", "domino"))


def app_builder(args: dict) -> serve.Application:
    """`serve run` / `serve deploy` entry: args `{config: path or null, overrides: [key=value, ...]}`."""
    unknown = set(args) - {"config", "overrides"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected config and overrides")
    overrides = args.get("overrides") or []
    if isinstance(overrides, str):
        overrides = overrides.split()
    return build_app(load_config(args.get("config"), list(overrides)))
