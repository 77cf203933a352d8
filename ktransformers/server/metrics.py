"""Prometheus metrics for ``GET /metrics``, in their own registry (never the process-global one,
so several apps in one process — tests — do not collide).

Two kinds:

* recorded by the engine as things happen: generated tokens (a counter: tokens/s is
  ``rate(ktransformers_generated_tokens_total[1m])``), time to first token and request duration
  (histograms, seconds, from the request's arrival);
* read from ``engine.status()`` at scrape time (:class:`EngineStatusCollector`): requests
  running / waiting, finished requests by outcome, KV pages used / free and the prefix cache's
  per-tier counters, whichever of these the engine reports.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

PREFIX = "ktransformers"
#: TTFT spans ~10 ms (a cached prefix on a small model) to minutes (a long prompt on a big one)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

__all__ = ["CONTENT_TYPE_LATEST", "EngineStatusCollector", "ServerMetrics"]


class ServerMetrics:
    """The metrics of one engine; ``render()`` is the /metrics body (Prometheus text format)."""

    def __init__(self, engine=None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated (sampled), all requests",
                                        registry=self.registry)
        self.time_to_first_token = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first generated token",
                                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.request_duration = Histogram(f"{PREFIX}_request_duration_seconds",
                                          "Seconds from a request's arrival to its end (any outcome)",
                                          buckets=DURATION_BUCKETS, registry=self.registry)
        self.drafted_tokens = Counter(f"{PREFIX}_speculative_drafted_tokens",
                                      "Tokens guessed by speculative decoding (--speculative), all requests",
                                      registry=self.registry)
        self.accepted_tokens = Counter(f"{PREFIX}_speculative_accepted_tokens",
                                       "Guessed tokens the model kept (accepted / drafted = the acceptance rate)",
                                       registry=self.registry)
        self._collector = None
        if engine is not None:
            self.watch(engine)

    def watch(self, engine) -> None:
        """Read ``engine.status()`` at every scrape (replaces an engine watched before)."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = EngineStatusCollector(engine)
        self.registry.register(self._collector)

    def record_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, float(seconds)))

    def record_tokens(self, n: int = 1) -> None:
        if n > 0:
            self.generated_tokens.inc(n)

    def record_speculation(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.drafted_tokens.inc(drafted)
            self.accepted_tokens.inc(max(0, accepted))

    def record_request(self, seconds: float) -> None:
        self.request_duration.observe(max(0.0, float(seconds)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _count(v) -> int:
    """Running requests as today's engine (None / one dict) or a batching one (int / list) says."""
    if v is None:
        return 0
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return int(v)
    if isinstance(v, (list, tuple, set)):
        return len(v)
    return 1


def _pages(status: dict) -> tuple[int | None, int | None]:
    pages = status.get("pages")
    if isinstance(pages, dict):
        return pages.get("used"), pages.get("free")
    return status.get("pages_used"), status.get("pages_free")


class EngineStatusCollector:
    """Gauges and counters from ``engine.status()``, read when Prometheus scrapes.

    Keys read (each optional): ``running`` (None, a dict, a count or a list), ``waiting``,
    ``completed`` / ``cancelled`` / ``failed``, ``pages`` = ``{"used", "free"}`` (or
    ``pages_used`` / ``pages_free``), ``prefix_cache`` = :meth:`PrefixCache.stats`."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # families depend on what status() reports: nothing to check at registration

    def collect(self):
        st = self.engine.status() or {}
        g = GaugeMetricFamily(f"{PREFIX}_requests_running", "Requests being generated now")
        g.add_metric([], _count(st.get("running")))
        yield g
        g = GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Requests queued, not started")
        g.add_metric([], _count(st.get("waiting")))
        yield g
        outcomes = {k: st[k] for k in ("completed", "cancelled", "failed") if isinstance(st.get(k), int)}
        if outcomes:
            c = CounterMetricFamily(f"{PREFIX}_requests_finished", "Finished requests by outcome",
                                    labels=["outcome"])
            for k, v in outcomes.items():
                c.add_metric([k], v)
            yield c
        used, free = _pages(st)
        if used is not None:
            g = GaugeMetricFamily(f"{PREFIX}_kv_pages_used", "KV cache pages in use (requests + prefix cache)")
            g.add_metric([], used)
            yield g
        if free is not None:
            g = GaugeMetricFamily(f"{PREFIX}_kv_pages_free", "KV cache pages free")
            g.add_metric([], free)
            yield g
        pc = st.get("prefix_cache")
        if isinstance(pc, dict) and isinstance(pc.get("tiers"), dict):
            yield from _prefix_families(pc)


def _prefix_families(pc: dict):
    tiers = pc["tiers"]
    fams = {
        "hits": CounterMetricFamily(f"{PREFIX}_prefix_cache_hits", "Prompt pages served from a prefix-cache tier",
                                    labels=["tier"]),
        "misses": CounterMetricFamily(f"{PREFIX}_prefix_cache_misses", "Prompt page lookups a tier could not serve",
                                      labels=["tier"]),
        "tokens": CounterMetricFamily(f"{PREFIX}_prefix_cache_hit_tokens",
                                      "Prompt tokens not prefilled thanks to a tier", labels=["tier"]),
        "evicted": CounterMetricFamily(f"{PREFIX}_prefix_cache_evictions", "Pages evicted from a tier",
                                       labels=["tier"]),
        "pages": GaugeMetricFamily(f"{PREFIX}_prefix_cache_pages", "Pages resident in a tier", labels=["tier"]),
        "bytes": GaugeMetricFamily(f"{PREFIX}_prefix_cache_bytes", "Bytes resident in a tier", labels=["tier"]),
        "capacity_bytes": GaugeMetricFamily(f"{PREFIX}_prefix_cache_capacity_bytes", "Byte limit of a tier",
                                            labels=["tier"]),
    }
    for tier, s in tiers.items():
        for k, fam in fams.items():
            v = s.get(k) if isinstance(s, dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                fam.add_metric([tier], v)
    yield from fams.values()
    for key, help_ in (("lookup_tokens", "Prompt tokens looked up in the prefix cache"),
                       ("matched_tokens", "Prompt tokens served by the prefix cache"),
                       ("dropped_files", "Prefix-cache files skipped and deleted (corrupt, truncated, foreign)")):
        if isinstance(pc.get(key), int):
            c = CounterMetricFamily(f"{PREFIX}_prefix_cache_{key}", help_)
            c.add_metric([], pc[key])
            yield c
