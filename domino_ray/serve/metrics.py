"""The Serve replica's Prometheus-style metrics (exported by Ray as `ray_domino_*`): requests by route and
status, tokens and acceptance statistics as the responses' usage reports them, latency histograms, and the
engine's paged KV cache (`SpecEngine.kv_cache_stats()`, read as each request ends)."""

import time
from typing import Callable

from ray.util import metrics

from domino_ray.serve.choices import Piece

TTFT_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# The engine's KV cache figures (`blocks.KVCacheStats`), all gauges: the pool's size, its peaks and its event counts
# since the replica started (gauges, not counters, so that a replica that never preempted shows its 0).
KV_CACHE = {"block_size": "positions per KV block", "blocks": "KV blocks in the pool (the null block not counted)",
            "peak_blocks_used": "most KV blocks in use at once", "peak_rows": "most rows in flight at once",
            "preemptions": "rows that gave their KV blocks back mid-generation (prefilled again later)",
            "prefix_hit_tokens": "prompt tokens not prefilled: their KV blocks were shared with a row in flight"}


class Metrics:
    """Prometheus-style counters (exported by Ray as `ray_domino_*`); acceptance rate = accepted / draft."""

    def __init__(self, model: str, kv_cache: Callable[[], dict[str, int]] | None = None):
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
        self.kv_cache = kv_cache  # the engine's kv_cache_stats
        self.kv_gauges = {name: _gauge(f"domino_kv_cache_{name}", doc, tags) for name, doc in KV_CACHE.items()}
        self.observe_kv_cache()

    def observe_kv_cache(self):
        if self.kv_cache is not None:
            for name, value in self.kv_cache().items():
                self.kv_gauges[name].set(value)

    def ended(self, route: str, status: str, pieces: list[Piece] = (), started: float | None = None):
        """Count one request by status; `pieces`: each choice's latest. Its tokens and statistics as usage
        reports them, also for a request cut short (client gone, error mid-stream)."""
        self.requests.inc(tags={"route": route, "status": status})
        for piece in pieces:
            stats = piece.stats
            for counter, value in ((self.generated, piece.num_tokens), (self.draft, stats.num_draft_tokens),
                                   (self.accepted, stats.num_accepted_draft_tokens),
                                   (self.steps, stats.num_spec_steps)):
                if value:  # Ray counters refuse inc(0)
                    counter.inc(value)
            for width, steps in enumerate(stats.verify_width_histogram):
                if steps:
                    self.widths.inc(steps, tags={"width": str(width)})
        if status == "200" and started is not None:  # every choice got its last token
            self.latency.observe(time.perf_counter() - started)
        self.observe_kv_cache()


def _counter(name: str, description: str, tags: dict) -> metrics.Counter:
    counter = metrics.Counter(name, description, tag_keys=tuple(tags))
    counter.set_default_tags(tags)
    return counter


def _gauge(name: str, description: str, tags: dict) -> metrics.Gauge:
    gauge = metrics.Gauge(name, description, tag_keys=tuple(tags))
    gauge.set_default_tags(tags)
    return gauge
