"""GET /metrics: Prometheus text format from the server's own registry; counters and histograms
follow real requests, gauges follow engine.status() at scrape time."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ktransformers.server.metrics import ServerMetrics


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_follow_real_requests(live_app):
    with live_app() as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r0 = c.get("/metrics")
        assert r0.status_code == 200 and r0.headers["content-type"].startswith("text/plain")
        s0 = _samples(r0.text)
        assert s0[("ktransformers_requests_running", ())] == 0
        assert s0[("ktransformers_generated_tokens_total", ())] == 0
        used = 0
        for prompt in ("hello there", "what is two plus two"):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200
            used += r.json()["usage"]["completion_tokens"]
        s = _samples(c.get("/metrics").text)
    assert used > 0
    assert s[("ktransformers_generated_tokens_total", ())] == used
    assert s[("ktransformers_time_to_first_token_seconds_count", ())] == 2
    assert 0 < s[("ktransformers_time_to_first_token_seconds_sum", ())] < 60
    assert s[("ktransformers_request_duration_seconds_count", ())] == 2
    ttft_sum = s[("ktransformers_time_to_first_token_seconds_sum", ())]
    assert s[("ktransformers_request_duration_seconds_sum", ())] >= ttft_sum
    assert s[("ktransformers_requests_finished_total", (("outcome", "completed"),))] == 2
    assert s[("ktransformers_requests_waiting", ())] == 0


def test_metrics_need_the_api_key_when_set(live_app):
    with live_app(api_key="sekret") as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and "ktransformers_generated_tokens_total" in r.text


class _BatchingStatus:
    """status() as a batching engine with a paged pool and a prefix cache reports it."""

    def __init__(self):
        self.st = {"running": 3, "waiting": 2, "completed": 7, "cancelled": 1, "failed": 0,
                   "pages": {"used": 40, "free": 24, "total": 64},
                   "prefix_cache": {"lookups": 5, "lookup_tokens": 900, "matched_tokens": 640, "dropped_files": 1,
                                    "tiers": {"device": {"hits": 30, "misses": 10, "tokens": 480, "pages": 12,
                                                         "bytes": None, "capacity_bytes": None, "evicted": 2},
                                              "ram": {"hits": 6, "misses": 4, "tokens": 96, "pages": 3,
                                                      "bytes": 3000, "capacity_bytes": 10000, "evicted": 0},
                                              "disk": {"hits": 4, "misses": 0, "tokens": 64, "pages": 9,
                                                       "bytes": 9100, "capacity_bytes": 50000, "evicted": 0}}}}

    def status(self):
        return self.st


def test_status_collector_reads_pages_and_prefix_tiers_at_scrape_time():
    eng = _BatchingStatus()
    m = ServerMetrics(eng)
    m.record_tokens(5)
    m.record_first_token(0.2)
    s = _samples(m.render().decode())
    assert s[("ktransformers_requests_running", ())] == 3
    assert s[("ktransformers_requests_waiting", ())] == 2
    assert s[("ktransformers_kv_pages_used", ())] == 40 and s[("ktransformers_kv_pages_free", ())] == 24
    assert s[("ktransformers_prefix_cache_hits_total", (("tier", "disk"),))] == 4
    assert s[("ktransformers_prefix_cache_hit_tokens_total", (("tier", "device"),))] == 480
    assert s[("ktransformers_prefix_cache_bytes", (("tier", "ram"),))] == 3000
    assert ("ktransformers_prefix_cache_bytes", (("tier", "device"),)) not in s   # unknown: left out
    assert s[("ktransformers_prefix_cache_matched_tokens_total", ())] == 640
    assert s[("ktransformers_generated_tokens_total", ())] == 5
    assert s[("ktransformers_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    eng.st["running"] = 0
    eng.st["pages"]["used"] = 0
    s = _samples(m.render().decode())
    assert s[("ktransformers_requests_running", ())] == 0 and s[("ktransformers_kv_pages_used", ())] == 0


def test_today_engine_status_without_pages_gives_no_page_gauges():
    class One:
        def status(self):
            return {"running": {"id": 1, "tag": "x", "prompt_tokens": 3}, "waiting": 0, "completed": 0,
                    "cancelled": 0, "failed": 0}

    s = _samples(ServerMetrics(One()).render().decode())
    assert s[("ktransformers_requests_running", ())] == 1
    assert not any(k[0].startswith("ktransformers_kv_pages") for k in s)
