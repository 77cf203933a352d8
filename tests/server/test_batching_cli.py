"""Batching flags: validation (one-line errors), defaults, and which engine each backend builds."""

from __future__ import annotations

import asyncio

import pytest

from ktransformers.server.engine import Engine, GenerationRequest, QueueFull
from ktransformers.server.main import build_engine, main, parse_settings


def _run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv, needle", [
    (["--backend_type", "vllm"], "--backend_type"),
    (["--max_batch_size", "0"], "--max_batch_size 0"),
    (["--page_size", "-4"], "--page_size -4"),
    (["--chunk_size", "0"], "--chunk_size 0"),
    (["--cache_lens", "32", "--page_size", "64"], "--cache_lens 32: must hold at least one page"),
    (["--prefix_cache_ram_gb", "-1"], "--prefix_cache_ram_gb"),
    (["--prefix_cache_disk_gb", "2"], "needs --prefix_cache_dir"),
])
def test_bad_batching_values(capsys, tiny_dir, argv, needle):
    rc, err = _run(capsys, "--model_path", str(tiny_dir), *argv)
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_a_pool_larger_than_memory_is_refused_before_allocating(capsys, tiny_dir, tmp_path):
    rc, err = _run(capsys, "--model_path", str(tiny_dir), "--data_dir", str(tmp_path), "--cache_lens", str(10**15))
    last = err.splitlines()[-1]  # after the loading log lines
    assert rc == 2 and last.startswith(f"error: --cache_lens {10**15}: ") and last.endswith(
        "GiB available; lower --cache_lens"), err


def test_defaults_and_backends(tiny_dir):
    from ktransformers.server.batch_engine import BatchEngine

    s = parse_settings(["--model_path", str(tiny_dir)])
    assert (s.backend_type, s.max_batch_size, s.page_size, s.prefill_chunk) == ("balance_serve", 8, 64, 512)
    assert parse_settings(["--model_path", str(tiny_dir), "--backend_type", "ktransformers"]).prefill_chunk == 8192
    batch = build_engine(parse_settings(["--model_path", str(tiny_dir), "--cache_lens", "1000", "--page_size", "32",
                                         "--max_batch_size", "3", "--chunk_size", "40"]))
    assert isinstance(batch, BatchEngine)
    st = batch.status()
    assert st["kv_pages"]["total"] == 1000 // 32 and st["kv_pages"]["page_size"] == 32
    assert (st["max_batch_size"], st["chunk_size"], batch.max_context) == (3, 40, 992)
    single = build_engine(parse_settings(["--model_path", str(tiny_dir), "--backend_type", "ktransformers",
                                          "--cache_lens", "1000"]))
    assert type(single) is Engine and single.max_context == 1000


def test_a_model_the_pages_cannot_hold_is_served_one_at_a_time(tiny_model_dir, caplog):
    from ktransformers.server.engine import Engine

    d = tiny_model_dir("gpt_oss")  # attention sinks: no paged path
    with caplog.at_level("WARNING", logger="ktransformers.server"):
        engine = build_engine(parse_settings(["--model_path", str(d), "--cache_lens", "512"]))
    assert type(engine) is Engine and engine.max_context == 512
    assert "continuous batching is not available for this model" in caplog.text and "sinks" in caplog.text


def test_queue_full_counts_free_batch_slots(tiny):
    from ktransformers.generation import Generator
    from ktransformers.server.batch_engine import BatchEngine
    from ktransformers.server.reference_runner import BatchRunner

    model, tok = tiny
    engine = BatchEngine(Generator(model, tok), tok, BatchRunner(model, page_size=16, num_pages=16),
                         model_name="tiny", max_context=256, max_batch_size=2, chunk_size=32, max_queue=1)

    async def main():  # the worker is not started: everything submitted stays queued
        for _ in range(3):  # two will take the free batch slots, one may wait
            await engine.submit(GenerationRequest([5, 6, 7], max_new_tokens=2))
        with pytest.raises(QueueFull) as e:
            await engine.submit(GenerationRequest([5, 6, 7], max_new_tokens=2))
        assert e.value.status == 503 and int(e.value.headers["Retry-After"]) >= 1

    asyncio.run(main())
