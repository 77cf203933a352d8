"""Continuous batching never changes results: requests run together (staggered arrivals,
different lengths, stop strings, a seeded sampler, one cancelled midway, preemption with a tiny
KV pool) give token for token what the single-request Generator gives each of them alone."""

from __future__ import annotations

import asyncio

import pytest

from ktransformers.generation import Generator, SamplingParams
from ktransformers.server.batch_engine import BatchEngine, runner_class
from ktransformers.server.engine import GenerationRequest, SamplingDefaults
from ktransformers.server.reference_runner import BatchRunner as ReferenceRunner
from ktransformers.server.reference_runner import PagePool
from ktransformers.server.scheduler import Scheduler, Sequence

MAX_NEW = 14
CANCEL_MAX_NEW = 200


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoTokenizer

    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    write_tiny_model("llama", d, max_position_embeddings=2048)
    return load_model(d / "model.safetensors", d, device="cpu"), AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(params=["llama", "qwen3_moe"])
def model_tok(request, tiny_llama):
    if request.param == "llama":
        return tiny_llama
    return request.getfixturevalue("tiny")  # conftest: qwen3_moe, routed experts on the CPU kernels


def _engine(model, tok, *, num_pages=128, page_size=16, max_batch_size=3, chunk_size=16, runner=None):
    gen = Generator(model, tok)
    runner = runner or runner_class()(model, page_size=page_size, num_pages=num_pages)
    return BatchEngine(gen, tok, runner, model_name="tiny", max_context=2048, max_batch_size=max_batch_size,
                       chunk_size=chunk_size, defaults=SamplingDefaults(max_new_tokens=MAX_NEW), max_queue=32)


def _cases(gen, tok):
    """(prompt ids, request kwargs): different lengths, stop strings taken from the greedy answer, a
    seeded sampler, a repetition penalty."""
    texts = ["Hi", "Dear Sir or Madam, I write to you about", "a b c d e f g", "Once upon a time",
             "one two three four five six", "zz"]
    cases = [(tok.encode(t), {}) for t in texts]
    for i in (1, 3):  # stop on a piece of what greedy would say
        text, _, _ = gen.generate(cases[i][0], SamplingParams(max_new_tokens=MAX_NEW))
        if len(text) >= 6:
            cases[i] = (cases[i][0], {"stop": [text[3:5]]})
    cases[2] = (cases[2][0], {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 1234})
    cases[4] = (cases[4][0], {"repetition_penalty": 1.3})
    return cases


def _assert_varied(expected):
    """The prompts are chosen so that the tiny random models' answers depend on their context (not
    one token repeated): a wrong cache would change them."""
    varied = [len(set(toks)) >= 4 for toks, _, reason in expected if reason != "stop"]
    assert sum(varied) >= len(varied) - 1, [e[0] for e in expected]


def _alone(gen, ids, kw):
    params = SamplingParams(**{"max_new_tokens": MAX_NEW, **kw}).validate()
    text, toks, reason = gen.generate(ids, params)
    return toks, text, reason


async def _run(engine, ids, kw, delay, cancel_after=None):
    await asyncio.sleep(delay)
    stream = await engine.submit(GenerationRequest(ids, **{"max_new_tokens": MAX_NEW, **kw}))
    toks, parts, reason = [], [], None
    async for ev in stream:
        if ev.token_id is not None:
            toks.append(ev.token_id)
        parts.append(ev.text)
        reason = ev.finish_reason or reason
        if cancel_after is not None and len(toks) == cancel_after:
            stream.cancel()
    return toks, "".join(parts), reason


def _serve_all(engine, cases, cancel_index=None, stagger=0.02):
    """Serve ``cases`` concurrently, request i arriving ``stagger * i`` seconds after the first."""
    async def main():
        return await asyncio.gather(*[
            _run(engine, ids, kw, stagger * i, cancel_after=3 if i == cancel_index else None)
            for i, (ids, kw) in enumerate(cases)])

    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def test_batched_equals_alone(model_tok):
    model, tok = model_tok
    gen = Generator(model, tok)
    cases = _cases(gen, tok)
    # the cancelled one may run far: the engine thread can produce many tokens before the client
    # reads its third and cancels, which must still land before the request could finish
    cases.append((tok.encode("Q: what is 17 + 25? A:"), {"max_new_tokens": CANCEL_MAX_NEW}))
    expected = [_alone(gen, ids, kw) for ids, kw in cases]
    _assert_varied(expected)
    engine = _engine(model, tok)
    got = _serve_all(engine, cases, cancel_index=len(cases) - 1)
    for i, ((toks, text, reason), (etoks, etext, ereason)) in enumerate(zip(got[:-1], expected[:-1])):
        assert toks == etoks, f"request {i}: batched tokens differ from the request alone"
        assert (text, reason) == (etext, ereason), f"request {i}"
    toks, _, reason = got[-1]
    assert reason == "cancelled" and toks == expected[-1][0][:len(toks)] and 3 <= len(toks) < CANCEL_MAX_NEW
    assert any(kw.get("stop") for _, kw in cases)
    st = engine.status()
    assert st["kv_pages"]["free"] == st["kv_pages"]["total"] and st["running"] == 0 and st["waiting"] == 0
    assert st["completed"] == len(cases) - 1 and st["cancelled"] == 1
    assert engine.steps < sum(len(ids) + kw.get("max_new_tokens", MAX_NEW) for ids, kw in cases)  # requests did share steps


def test_preemption_keeps_outputs(model_tok):
    """A pool too small for the batch: the youngest is preempted and recomputed; every request
    finishes with the tokens it gets alone."""
    model, tok = model_tok
    gen = Generator(model, tok)
    texts = ["Dear Sir or Madam, I write to you about", "Once upon a time", "def fib(n):\n    return",
             "Q: what is 17 + 25? A:", "one two three four five six"]
    cases = [(tok.encode(t), {}) for t in texts]
    expected = [_alone(gen, ids, kw) for ids, kw in cases]
    _assert_varied(expected)
    longest = max(len(ids) for ids, _ in cases) + MAX_NEW
    engine = _engine(model, tok, num_pages=-(-longest // 8) + 1, page_size=8, max_batch_size=4, chunk_size=24)
    got = _serve_all(engine, cases, stagger=0.0)  # all at once: however fast a step is, the pool runs out
    assert engine.scheduler.preemptions > 0
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[2] for g in got] == [e[2] for e in expected]
    st = engine.status()
    assert st["kv_pages"]["free"] == st["kv_pages"]["total"] and st["failed"] == 0


def test_never_fitting_request_is_refused(tiny_llama):
    from ktransformers.server.errors import APIError

    model, tok = tiny_llama
    engine = _engine(model, tok, num_pages=4, page_size=16)  # 64 tokens in all
    assert engine.max_context == 64

    async def submit(ids, n):
        return await engine.submit(GenerationRequest(ids, max_new_tokens=n))

    with pytest.raises(APIError) as e:
        asyncio.run(submit(list(range(1, 70)), 4))
    assert e.value.status == 400 and "--cache_lens" in e.value.message
    with pytest.raises(APIError) as e:
        asyncio.run(submit(list(range(1, 40)), 30))
    assert e.value.status == 400 and e.value.param == "max_tokens" and "at most 25" in e.value.message


def test_runner_choice_is_the_paged_one_when_installed():
    try:
        from ktransformers.generation.paged import BatchRunner
    except ImportError:
        BatchRunner = ReferenceRunner
    assert runner_class() is BatchRunner


# ---- the scheduler alone, over counted pages ------------------------------------------------

class CountingRunner:
    """The runner interface with pages counted and no model: step appends the chunks."""

    def __init__(self, page_size=4, num_pages=64):
        self.pool = PagePool(num_pages, page_size)
        self.lens, self.pages, self.steps = {}, {}, []

    def begin(self, seq_id, prefix_pages=(), prefix_len=0):
        self.lens[seq_id], self.pages[seq_id] = prefix_len, list(prefix_pages)
        for p in prefix_pages:
            self.pool.incref(p)

    def pages_needed(self, seq_id, n_new):
        return max(0, -(-(self.lens.get(seq_id, 0) + n_new) // self.pool.page_size) - len(self.pages.get(seq_id, [])))

    def seq_pages(self, seq_id):
        return list(self.pages[seq_id])

    def release(self, seq_id):
        for p in self.pages.pop(seq_id, []):
            self.pool.decref(p)
        self.lens.pop(seq_id, None)

    def step(self, chunks):
        for sid, n in chunks:
            for _ in range(self.pages_needed(sid, n)):
                self.pages[sid].append(self.pool.alloc())
            self.lens[sid] += n
        self.steps.append(list(chunks))


def _drive(sched, runner, max_steps=500, on_step=None):
    """Run the scheduler to the end, 'sampling' token 7 for every due sequence."""
    for _ in range(max_steps):
        chunks = sched.schedule()
        if not chunks:
            return
        runner.step([(s.seq_id, n) for s, n in chunks])
        for s in sched.advance(chunks):
            s.generated.append(7)
            if len(s.generated) >= s.max_new_tokens:
                sched.finish(s)
        if on_step:
            on_step(chunks)
    raise AssertionError("scheduler did not finish")


def test_long_prompt_never_stalls_decoding():
    runner = CountingRunner()
    sched = Scheduler(runner, max_batch_size=4, chunk_size=8)
    a = Sequence(1, [1, 2, 3], max_new_tokens=30)
    sched.add(a)
    sched.schedule()  # a is prefilled in one step
    runner.step([(1, 3)])
    sched.advance([(a, 3)])
    a.generated.append(7)
    sched.add(Sequence(2, list(range(100)), max_new_tokens=2))
    seen = []

    def check(chunks):
        if a in sched.running:
            assert (a, 1) in chunks  # the decode runs every step
        assert sum(n for _, n in chunks) <= 8
        seen.append(chunks)

    _drive(sched, runner, on_step=check)
    assert len([c for c in seen if any(s.seq_id == 2 and n > 1 for s, n in c)]) >= 100 // 8
    assert runner.pool.free_count() == runner.pool.num_pages


def test_fcfs_and_max_batch_size():
    runner = CountingRunner()
    sched = Scheduler(runner, max_batch_size=2, chunk_size=64)
    seqs = [Sequence(i, [1] * 5, max_new_tokens=3) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    order = []

    def check(chunks):
        assert len(sched.running) <= 2
        for s, _ in chunks:
            if s.seq_id not in order:
                order.append(s.seq_id)

    _drive(sched, runner, on_step=check)
    assert order == [1, 2, 3, 4]


def test_youngest_is_preempted_and_recomputed():
    runner = CountingRunner(page_size=4, num_pages=6)  # 24 tokens for everyone
    sched = Scheduler(runner, max_batch_size=4, chunk_size=64)
    old, young = Sequence(1, [1] * 7, max_new_tokens=10), Sequence(2, [2] * 7, max_new_tokens=10)
    sched.add(old)
    sched.add(young)
    preempted = []

    def check(chunks):
        if sched.preemptions and not preempted:
            preempted.append(young.preemptions)
            assert old.preemptions == 0
    _drive(sched, runner, on_step=check)
    assert preempted == [1] and old.generated == [7] * 10 and young.generated == [7] * 10
    # the preempted request was re-prefilled with its prompt and the tokens it had generated
    assert any((2, n) in step and n > 7 for step in runner.steps for n in range(8, 20))
    assert runner.pool.free_count() == runner.pool.num_pages


def test_cancel_frees_pages_at_once():
    runner = CountingRunner()
    sched = Scheduler(runner, max_batch_size=4, chunk_size=64)
    s = Sequence(1, [1] * 10, max_new_tokens=10)
    sched.add(s)
    chunks = sched.schedule()
    runner.step([(x.seq_id, n) for x, n in chunks])
    sched.advance(chunks)
    assert runner.pool.used_count() == 3
    sched.drop(s)
    assert runner.pool.used_count() == 0 and not sched.has_work()


# ---- the prefix-cache interface, with a minimal in-test cache --------------------------------

class DictPrefixCache:
    """The PrefixCache interface over a dict of full-page token prefixes (no tiers, no eviction)."""

    def __init__(self, pool):
        self.pool, self.index, self.hits, self.inserts = pool, {}, 0, 0

    def match(self, token_ids, count=True):
        ps, pages = self.pool.page_size, []
        k = 1
        while k * ps < len(token_ids) and tuple(token_ids[:k * ps]) in self.index:
            pages = self.index[tuple(token_ids[:k * ps])]
            k += 1
        for p in pages:
            self.pool.incref(p)
        self.hits += bool(pages) and count
        return list(pages), len(pages) * ps, {"device": len(pages), "ram": 0, "disk": 0}

    def insert(self, token_ids, pages):
        ps = self.pool.page_size
        for k in range(1, len(token_ids) // ps + 1):
            key = tuple(token_ids[:k * ps])
            if key not in self.index:
                for p in pages[:k]:
                    self.pool.incref(p)
                self.index[key] = list(pages[:k])
                self.inserts += 1

    def stats(self):
        return {"hits": self.hits, "entries": len(self.index)}


def test_prefix_cache_reuse_prefills_only_the_rest(tiny_llama):
    model, tok = tiny_llama
    gen = Generator(model, tok)
    shared = tok.encode("You are a helpful assistant. Answer briefly and politely. ")
    first, second = shared + tok.encode("Question one?"), shared + tok.encode("Another question!")
    expected = _alone(gen, second, {})
    runner = ReferenceRunner(model, page_size=8, num_pages=64)
    cache = DictPrefixCache(runner.pool)
    engine = BatchEngine(gen, tok, runner, model_name="tiny", max_context=512, max_batch_size=2, chunk_size=16,
                         prefix_cache=cache, defaults=SamplingDefaults(max_new_tokens=MAX_NEW), max_queue=4)
    fed = []
    step = runner.step
    runner.step = lambda chunks, prompt=(): (fed.extend(n for sid, ids in chunks if sid == 2 for n in [len(ids)]),
                                             step(chunks, prompt))[1]

    async def main():
        a = await _run(engine, first, {}, 0)
        s = await engine.submit(GenerationRequest(second, max_new_tokens=MAX_NEW))
        toks = [ev.token_id async for ev in s if ev.token_id is not None]
        return a, s, toks

    engine.start()
    try:
        _, stream, toks = asyncio.run(main())
    finally:
        engine.shutdown()
    n_cached = (len(shared) // 8) * 8
    assert stream.cached_tokens == n_cached > 0 and stream.stats.cached_tokens == n_cached
    assert sum(fed) == len(second) - n_cached + len(toks) - 1  # only the rest was prefilled, then decoded
    assert toks == expected[0]  # reused K/V gives the cold run's tokens
    st = engine.status()
    assert st["prefix_cache"]["hits"] == 1 and st["running"] == 0


def test_tight_pool_reuses_the_whole_cached_prefix(tiny_llama):
    """A second prompt with the first one's 4-page start, on a pool too small for its cold first
    chunk: room is made for the rest without evicting the pages it reuses, and it gets the cold
    run's tokens."""
    from ktransformers.server.prefix_cache import PrefixCache

    model, tok = tiny_llama
    gen = Generator(model, tok)
    ps = 8
    shared = tok.encode("You are a helpful assistant. Answer briefly and politely, and never make things up. "
                        "Think first.")[:4 * ps]
    assert len(shared) == 4 * ps
    first, second = shared + tok.encode(" Question one?"), shared + tok.encode(" Another question!")
    expected = _alone(gen, second, {})
    runner = ReferenceRunner(model, page_size=ps, num_pages=8)
    cache = PrefixCache(runner.pool, fingerprint="tiny", page_size=ps)
    engine = BatchEngine(gen, tok, runner, model_name="tiny", max_context=512, max_batch_size=2, chunk_size=64,
                         prefix_cache=cache, defaults=SamplingDefaults(max_new_tokens=MAX_NEW), max_queue=4)
    free_before = []

    async def main():
        await _run(engine, first, {}, 0)
        free_before.append(runner.pool.free_count())
        s = await engine.submit(GenerationRequest(second, max_new_tokens=MAX_NEW))
        toks = [ev.token_id async for ev in s if ev.token_id is not None]
        return s, toks

    engine.start()
    try:
        stream, toks = asyncio.run(main())
    finally:
        engine.shutdown()
    # the cold first chunk (the whole prompt) would not fit the free pages: admission must evict
    assert free_before[0] < -(-len(second) // ps)
    assert stream.cached_tokens == len(shared) and stream.stats.cached_tokens == len(shared)
    assert toks == expected[0]
    st = cache.stats()
    assert st["lookups"] == 2 and st["matched_tokens"] == len(shared)


def test_a_waiting_request_is_looked_up_once():
    """A request waiting for pages tries its lookup every step, holding the cached pages it would
    reuse only while room is made; the prefix cache counts one lookup per request."""
    from ktransformers.server.prefix_cache import PrefixCache

    runner = CountingRunner(page_size=4, num_pages=8)
    runner.pool.page_bytes = 1  # no K/V here: the cache's byte count needs a page size
    cache = PrefixCache(runner.pool, fingerprint="counting", page_size=4)
    sched = Scheduler(runner, max_batch_size=4, chunk_size=32, prefix_cache=cache)
    prefix = list(range(100, 108))
    sched.add(Sequence(0, prefix, max_new_tokens=1))
    _drive(sched, runner)  # its 2 pages stay cached
    a = Sequence(1, list(range(200, 220)), max_new_tokens=4)  # holds 6 of the 8 pages at its end
    sched.add(a)
    chunks = sched.schedule()
    runner.step([(s.seq_id, n) for s, n in chunks])
    for s in sched.advance(chunks):
        s.generated.append(7)
    b = Sequence(2, prefix + [1, 2, 3], max_new_tokens=2)
    sched.add(b)
    waited = []
    _drive(sched, runner, on_step=lambda chunks: waited.append(b in sched.waiting))
    assert sum(waited) >= 2  # b was looked up again at each of these steps
    assert b.cached_tokens == 8 and b.generated == [7, 7]
    st = cache.stats()
    assert st["lookups"] == 3 and st["lookup_tokens"] == 8 + 20 + 11 and st["matched_tokens"] == 8
    assert st["tiers"]["device"]["hits"] == 2


def test_model_failure_fails_only_its_batch(tiny_llama):
    """A forward that raises ends the requests of that step with an error; the engine keeps serving."""
    model, tok = tiny_llama
    engine = _engine(model, tok)
    step, calls = engine.runner.step, []

    def failing_once(chunks, prompt=()):
        calls.append(chunks)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return step(chunks, prompt)

    engine.runner.step = failing_once

    async def main():
        s = await engine.submit(GenerationRequest(tok.encode("Hi"), max_new_tokens=3))
        with pytest.raises(Exception, match="boom"):
            async for _ in s:
                pass
        return await _run(engine, tok.encode("Once upon a time"), {}, 0)

    engine.start()
    try:
        toks, _, reason = asyncio.run(main())
    finally:
        engine.shutdown()
    assert reason == "length" and len(toks) == MAX_NEW
    st = engine.status()
    assert st["failed"] == 1 and st["completed"] == 1 and st["kv_pages"]["free"] == st["kv_pages"]["total"]
