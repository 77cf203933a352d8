"""Prefix affinity against round-robin on a multi-turn trace, as the replicas' prefix caches see it.

Two replicas are two real batching engines of the tiny model, each with its own KV page pool and
:class:`~ktransformers.server.prefix_cache.PrefixCache`, each behind the server's own app
(``create_app``), called through :func:`~ktransformers.serve_cluster.asgi_call.call_asgi` as a
replica serves the router.  Four clients hold multi-turn chats; their turns arrive interleaved
in a seeded random order.  The hit rate is the caches' own count: prompt tokens matched over
prompt tokens looked up.

Two pool sizes.  48 pages of 16 tokens per replica: a conversation's last prompt is ~570 tokens,
so a pool holds its share of the clients (two conversations on average over the trace) but not
all four -- the case of a real replica, whose pool is sized for its own load.  Round-robin puts
every conversation in both pools, which then evict; affinity keeps each on one: 2x the hit
rate.  400 pages: every pool holds everything, nothing is evicted, and round-robin loses only
the turns that land on the replica which did not serve the previous one (a stale, shorter
prefix there): affinity is still ahead, by less (1.4x).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from ktransformers.serve_cluster.asgi_call import ForwardedRequest, ResponseStart, call_asgi
from ktransformers.serve_cluster.routing import AffinityPolicy, route_keys

CLIENTS, TURNS = 4, 6
PAGE_SIZE = 16
PATH = "/v1/chat/completions"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()


def _replicas(tiny, tmp_path, num_pages: int):
    from ktransformers.generation import Generator
    from ktransformers.server import Settings, create_app
    from ktransformers.server.batch_engine import BatchEngine, runner_class
    from ktransformers.server.engine import SamplingDefaults
    from ktransformers.server.prefix_cache import PrefixCache

    model, tok = tiny
    apps = []
    for i in range(2):
        runner = runner_class()(model, page_size=PAGE_SIZE, num_pages=num_pages)
        cache = PrefixCache(runner.pool, fingerprint="tiny-trace", page_size=PAGE_SIZE)
        engine = BatchEngine(Generator(model, tok), tok, runner, model_name="tiny", max_context=2048,
                             max_batch_size=1, chunk_size=64, prefix_cache=cache, max_queue=4,
                             defaults=SamplingDefaults(max_new_tokens=6))
        apps.append(create_app(engine, Settings(data_dir=str(tmp_path / f"replica-{i}"))))
    return apps


def _user_turn(client: int, turn: int) -> str:
    rng = random.Random(client * 100 + turn)
    return f"client {client} turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(8))


def _arrivals(seed: int = 7) -> list[int]:
    """Client ids in arrival order: each client's turns in order, the clients interleaved at random."""
    order = [c for c in range(CLIENTS) for _ in range(TURNS)]
    random.Random(seed).shuffle(order)
    return order


async def _post(app, body: dict) -> dict:
    req = ForwardedRequest("POST", PATH, b"", [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
                           json.dumps(body).encode())
    status, chunks = None, []
    async for item in call_asgi(app, req):
        if isinstance(item, ResponseStart):
            status = item.status
        else:
            chunks.append(item)
    assert status == 200, b"".join(chunks)
    return json.loads(b"".join(chunks))


def run_trace(apps, pick) -> float:
    """Play the trace, each request sent to ``apps[pick(body)]``; the caches' hit rate."""
    chats = {c: [] for c in range(CLIENTS)}
    turns = {c: 0 for c in range(CLIENTS)}

    async def play():
        for c in _arrivals():
            chats[c].append({"role": "user", "content": _user_turn(c, turns[c])})
            turns[c] += 1
            body = {"model": "tiny", "messages": list(chats[c]), "max_tokens": 6, "temperature": 0}
            answer = await _post(apps[pick(body)], body)
            chats[c].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})

    for app in apps:
        app.state.engine.start()
    try:
        asyncio.run(play())
    finally:
        for app in apps:
            app.state.engine.shutdown()
    stats = [app.state.engine.prefix_cache.stats() for app in apps]
    return sum(s["matched_tokens"] for s in stats) / sum(s["lookup_tokens"] for s in stats)


def affinity_picker(policy: AffinityPolicy):
    def pick(body):
        keys = route_keys(PATH, json.dumps(body).encode())
        name = policy.choose(keys)
        policy.record(keys, name)
        return policy.replicas.index(name)
    return pick


def round_robin_picker():
    n = iter(range(10**9))
    return lambda body: next(n) % 2


@pytest.mark.parametrize("num_pages, at_least", [(48, 1.5), (400, 1.2)])
def test_affinity_hit_rate_against_round_robin(tiny, tmp_path, num_pages, at_least):
    affinity = run_trace(_replicas(tiny, tmp_path / "a", num_pages), affinity_picker(AffinityPolicy(["r0", "r1"])))
    round_robin = run_trace(_replicas(tiny, tmp_path / "b", num_pages), round_robin_picker())
    print(f"{num_pages} pages: prefix-cache hit rate: affinity {affinity:.3f}, round-robin {round_robin:.3f}")
    assert affinity >= at_least * round_robin, (affinity, round_robin)
    assert affinity > 0.5  # most of each follow-up turn's prompt was already cached
