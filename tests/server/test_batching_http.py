"""The batching engine behind the real app: 400 for a request that can never fit, /health's
batching fields, usage's cached_tokens, and a bounded loopback load test (16 streaming clients,
random disconnects; ``KT_LOAD_SECONDS`` sets its length, 15 s by default, 60 s for the full run)."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import httpx
import pytest

from ktransformers.generation import Generator
from ktransformers.server.batch_engine import BatchEngine
from ktransformers.server.engine import SamplingDefaults
from ktransformers.server.reference_runner import BatchRunner

from .conftest import MODEL_NAME

LOAD_SECONDS = float(os.environ.get("KT_LOAD_SECONDS", "60"))


@pytest.fixture
def batch_engine(tiny):
    def make(*, num_pages=64, page_size=16, max_batch_size=8, chunk_size=64, max_queue=16, max_new_tokens=8):
        model, tok = tiny
        runner = BatchRunner(model, page_size=page_size, num_pages=num_pages)
        return BatchEngine(Generator(model, tok), tok, runner, model_name=MODEL_NAME, max_context=2048,
                           max_batch_size=max_batch_size, chunk_size=chunk_size, max_queue=max_queue,
                           defaults=SamplingDefaults(max_new_tokens=max_new_tokens))

    return make


def _chat(content: str, **kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **kw}


def test_never_fitting_request_gets_400(live_app, batch_engine):
    with live_app(batch_engine(num_pages=8, page_size=16)) as srv:  # 128 tokens of KV in all
        r = httpx.post(srv.url + "/v1/chat/completions", json=_chat("hi", max_tokens=500), timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens" and "--cache_lens" in err["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json=_chat("long " * 100), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(srv.url + "/api/generate", json={"model": MODEL_NAME, "prompt": "hi",
                                                        "options": {"num_predict": 400}}, timeout=30)
        assert r.status_code == 400 and "--cache_lens" in r.json()["error"]
        r = httpx.post(srv.url + "/v1/chat/completions", json=_chat("hi", max_tokens=4), timeout=30)
        assert r.status_code == 200  # and the server is fine


def test_health_and_usage(live_app, batch_engine):
    with live_app(batch_engine()) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=_chat("hello", max_tokens=4), timeout=30)
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0} and usage["completion_tokens"] >= 1
        r = httpx.post(srv.url + "/api/generate", json={"model": MODEL_NAME, "prompt": "hello", "stream": False, "raw": True,
                                                        "options": {"num_predict": 3}}, timeout=30)
        body = r.json()
        assert body["prompt_eval_count"] == len(srv.engine.encode("hello")) and body["prompt_eval_duration"] > 0
        h = httpx.get(srv.url + "/health").json()
        assert h["backend"] == "balance_serve" and h["running"] == 0 and h["waiting"] == 0
        assert h["kv_pages"] == {"page_size": 16, "total": 64, "used": 0, "free": 64}
        assert h["max_batch_size"] == 8 and h["completed"] == 2


def _client(url: str, stop_at: float, seed: int, tally: dict, lock: threading.Lock) -> None:
    """Stream chats until ``stop_at``; about a third of them hang up after a few chunks."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as c:
        while time.time() < stop_at:
            hang_up = rng.random() < 0.35
            body = _chat("word " * rng.randint(1, 60), max_tokens=rng.randint(2, 24), stream=True,
                         temperature=rng.choice([0, 0.8]), seed=rng.randint(0, 1000))
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                key = f"status_{r.status_code}"
                done = finished = False
                if r.status_code == 200:
                    for i, line in enumerate(r.iter_lines()):
                        if hang_up and i >= rng.randint(1, 4):
                            break
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            d = json.loads(line[6:])
                            assert "error" not in d, d
                            if d["choices"] and d["choices"][0]["finish_reason"]:
                                finished = True
                    outcome = "completed" if (done and finished) else ("cancelled" if hang_up else "broken")
                else:
                    r.read()
                    outcome = "refused"
            with lock:
                tally[key] = tally.get(key, 0) + 1
                tally[outcome] = tally.get(outcome, 0) + 1


def test_load_sixteen_streaming_clients(live_app, batch_engine):
    """Bounded loopback load: each request completes or is cancelled, nothing fails, no 5xx, and
    every KV page is free again at the end."""
    engine = batch_engine(num_pages=48, page_size=16, max_batch_size=8, chunk_size=48, max_queue=16)
    with live_app(engine) as srv:
        tally, lock = {}, threading.Lock()
        stop_at = time.time() + LOAD_SECONDS
        threads = [threading.Thread(target=_client, args=(srv.url, stop_at, i, tally, lock)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(LOAD_SECONDS + 120)
        assert not any(t.is_alive() for t in threads), "a client hung"
        deadline = time.time() + 30
        while time.time() < deadline:
            st = engine.status()
            if st["running"] == 0 and st["waiting"] == 0:
                break
            time.sleep(0.1)
        st = engine.status()
        assert tally.get("broken", 0) == 0 and not any(k.startswith("status_5") for k in tally), tally
        assert tally.get("completed", 0) >= 16 and tally.get("cancelled", 0) >= 1, tally
        assert st["failed"] == 0 and st["running"] == 0 and st["waiting"] == 0, st
        assert st["kv_pages"]["free"] == st["kv_pages"]["total"], st
        assert httpx.get(srv.url + "/health").status_code == 200
        print("load:", tally, "preemptions:", st["preemptions"], "steps:", engine.steps)
