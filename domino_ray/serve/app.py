"""Ray Serve edge: one speculative engine per replica behind an OpenAI-compatible HTTP API.

    serve run deploy/serve.yaml              # or: python jobs/serve.py [--config FILE] [key=value ...]

Each replica loads the target (+ Domino draft) once and runs it on an `EngineLoop` thread; every HTTP
request submits one engine request and awaits its stream, so concurrent requests share the running
batch (continuous batching) and tokens stream back as they are committed. A client that goes away
cancels its handler, which aborts the engine request and frees its slot. Request parsing and response
building live in the Ray-free `openai_api`, the request's text stream in `text_stream`; this module is
FastAPI + Serve + metrics.

Overload is answered at once, never by unbounded waiting: beyond `serve.max_waiting_requests` waiting
for an engine slot the replica answers 429 (EngineLoop QueueFull); beyond `serve.max_ongoing_requests`
per replica, requests queue at the proxy up to `serve.max_queued_requests`, then Serve's proxy answers
429 itself (a plain-text body Serve 2.60 does not let an app shape; README "Overload").

Every request the replica sees shares its queue, `/health` too, so load balancers probe the `HealthProbe`
app (`build_health_app`, route `/health`): a replica-free deployment that reads Serve's own view of the
engine replicas (kept current by `check_health`), and so answers under any load. The replica's
`/load` (and, without the probe app, `/health`) reports its engine's running and waiting requests.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations as real types.
import asyncio
import logging
import time
import uuid

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, BackpressureConfig
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from domino_ray.config import JobConfig, generation_defaults, load_config
from domino_ray.engine.loop import EngineLoop
from domino_ray.llm import load_engine
from domino_ray.serve.openai_api import (SSE_DONE, APIError, ModelSpec, chunk_body, models_body, parse_request,
                                         response_body, sse, usage_chunk_body)
from domino_ray.serve.text_stream import Piece, generate

logger = logging.getLogger("ray.serve")
api = FastAPI(title="domino-ray", description="OpenAI-compatible speculative decoding (target + Domino draft)")
TTFT_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


class Metrics:
    """Prometheus-style counters (exported by Ray as `ray_domino_*`); acceptance rate = accepted / draft."""

    def __init__(self, model: str):
        tags = {"model": model}
        self.requests = metrics.Counter("domino_requests", "HTTP requests by route and status",
                                        tag_keys=("model", "route", "status"))
        self.requests.set_default_tags(tags)
        self.generated = _counter("domino_generated_tokens", "tokens generated", tags)
        self.draft = _counter("domino_draft_tokens", "draft tokens proposed (that could be accepted)", tags)
        self.accepted = _counter("domino_accepted_draft_tokens", "draft tokens accepted (bonus excluded)", tags)
        self.steps = _counter("domino_spec_steps", "target verify passes", tags)
        self.widths = metrics.Counter("domino_verify_width_steps", "verify passes by verify width (drafts verified)",
                                      tag_keys=("model", "width"))
        self.widths.set_default_tags(tags)
        self.ttft = metrics.Histogram("domino_time_to_first_token_s", "request arrival to first token, seconds",
                                      boundaries=TTFT_BOUNDARIES, tag_keys=("model",))
        self.ttft.set_default_tags(tags)
        self.latency = metrics.Histogram("domino_request_latency_s", "request arrival to last token, seconds",
                                         boundaries=LATENCY_BOUNDARIES, tag_keys=("model",))
        self.latency.set_default_tags(tags)

    def ended(self, route: str, status: str, piece: Piece | None = None, started: float | None = None):
        """Count one request by status; its tokens and statistics as usage reports them (a stop string's
        overshoot excluded), also for a request cut short (client gone, error mid-stream)."""
        self.requests.inc(tags={"route": route, "status": status})
        if piece is None:
            return
        stats = piece.stats
        for counter, value in ((self.generated, piece.num_tokens), (self.draft, stats.num_draft_tokens),
                               (self.accepted, stats.num_accepted_draft_tokens), (self.steps, stats.num_spec_steps)):
            if value:  # Ray counters refuse inc(0)
                counter.inc(value)
        for width, steps in enumerate(stats.verify_width_histogram):
            if steps:
                self.widths.inc(steps, tags={"width": str(width)})
        if piece.completion is not None and started is not None:
            self.latency.observe(time.perf_counter() - started)


def _counter(name: str, description: str, tags: dict) -> metrics.Counter:
    counter = metrics.Counter(name, description, tag_keys=tuple(tags))
    counter.set_default_tags(tags)
    return counter


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
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown routes and wrong methods answer with an OpenAI-style body too."""
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


@serve.deployment
@serve.ingress(api)
class DominoServer:
    def __init__(self, cfg: JobConfig):
        engine, self.tokenizer = load_engine(cfg.model, cfg.draft, cfg.generation, cfg.runtime)
        if engine.slot_report:
            logger.info("replica engine: %s", engine.slot_report)
        self.loop = EngineLoop(engine, max_waiting=cfg.serve.max_waiting_requests)
        self.model = ModelSpec(
            name=cfg.serve.model_name, tokenizer=self.tokenizer, vocab_size=engine.vocab_size,
            max_model_len=engine.max_model_len, enable_thinking=cfg.model.enable_thinking,
            parse_special_tokens=cfg.model.parse_special_tokens, defaults=generation_defaults(cfg.generation))
        self.created = int(time.time())
        self.metrics = Metrics(cfg.serve.model_name)
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
    async def models(self):
        return models_body(self.model, self.created)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._respond(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._respond(request, "chat")

    async def _respond(self, request: Request, kind: str):
        started, route = time.perf_counter(), kind
        try:
            raw = await read_body(request, self.max_request_bytes)
            # JSON and tokenization off the event loop: a big prompt must not stall /health or other streams.
            parsed = await asyncio.to_thread(parse_request, kind, raw, self.model)
            response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
            pieces = generate(self.loop, response_id, parsed, self.tokenizer)
            first = await anext(pieces)  # errors before the first token still get a proper status
        except APIError as exc:
            self.metrics.ended(route, str(exc.status))
            return _error(exc)
        except Exception as exc:
            error = _internal_error(exc)
            self.metrics.ended(route, str(error.status))
            return _error(error)
        self.metrics.ttft.observe(time.perf_counter() - started)
        args = (parsed, response_id, self.created, self.model.name)
        if parsed.stream:
            return StreamingResponse(self._stream(args, first, pieces, started, route),
                                     media_type="text/event-stream")
        texts, last, status = [first.text], first, "cancelled"  # stays "cancelled" if the client goes away
        try:
            while last.completion is None:
                last = await anext(pieces)
                texts.append(last.text)
            status = "200"
            return response_body(*args, "".join(texts), last.finish_reason, last.completion)
        except APIError as exc:
            status = str(exc.status)
            return _error(exc)
        except Exception as exc:
            error = _internal_error(exc)
            status = str(error.status)
            return _error(error)
        finally:
            await pieces.aclose()  # aborts the engine request unless it finished (e.g. the client left)
            self.metrics.ended(route, status, last, started)

    async def _stream(self, args, first, pieces, started: float, route: str):
        parsed = args[0]
        status, piece = "cancelled", first  # stays "cancelled" if the client goes away mid-stream
        try:
            yield sse(chunk_body(*args, piece.text, first=True))
            while piece.completion is None:
                piece = await anext(pieces)
                if piece.text:
                    yield sse(chunk_body(*args, piece.text))
            if parsed.include_usage:  # as OpenAI: the finishing chunk, then one with usage and no choices
                yield sse(chunk_body(*args, "", finish_reason=piece.finish_reason))
                yield sse(usage_chunk_body(*args, piece.completion))
            else:
                yield sse(chunk_body(*args, "", finish_reason=piece.finish_reason, completion=piece.completion))
            yield SSE_DONE
            status = "200"
        except Exception as exc:  # headers are sent: report in the stream, as OpenAI does
            error = exc if isinstance(exc, APIError) else _internal_error(exc)
            status = str(error.status)
            yield sse(error.body())
            yield SSE_DONE
        finally:
            await pieces.aclose()  # aborts the engine request unless it finished
            self.metrics.ended(route, status, piece, started)


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
    return DominoServer.options(**deployment_options(cfg)).bind(cfg)


# Ray's implicit resource of the head node (1 there, absent elsewhere): a sliver of it pins an actor there.
HEAD_NODE = {"node:__internal_head__": 0.001}


@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE}, max_ongoing_requests=1000,
                  max_queued_requests=-1)
class HealthProbe:
    """`GET /health` for load balancers: 200 while the engine app has a running replica, else 503.

    It never touches an engine replica (whose queue it would wait in): it asks the Serve controller,
    which health-checks the replicas itself (`DominoServer.check_health`) and replaces failed ones.
    It runs on the head node, beside the controller: placed on a worker node (Serve spreads replicas), it
    went down with that node, and /health timed out for ~30 s while its replacement started."""

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
