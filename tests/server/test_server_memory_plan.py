"""The server counts the KV cache of its context (``--cache_lens``, else the model's max positions)
in the memory plan: a start whose cache would not fit is refused with the figure, before any weight
is read."""

from __future__ import annotations

import importlib

import pytest

from ktransformers.optimize import build_model, explain_plan, plan_model
from ktransformers.optimize_rules import default_rule_file
from ktransformers.server.main import planned_context, main, parse_settings
from ktransformers.weights import open_weights
from ktransformers.weights.model_config import load_config


def _memory(tiny_dir, context):
    source = open_weights(tiny_dir / "model.safetensors")
    cfg = load_config(tiny_dir, source)
    model = build_model(cfg)
    return explain_plan(model, plan_model(model, default_rule_file(cfg, cuda=False), "cpu"), source,
                        context=context).memory


def _start(capsys, tiny_dir, tmp_path, monkeypatch, *argv):
    def serve(*a, **k):
        raise AssertionError("the server started")

    monkeypatch.setattr(importlib.import_module("uvicorn"), "run", serve)
    rc = main(["--model_path", str(tiny_dir), "--data_dir", str(tmp_path), "--device", "cpu", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, tokens", [
    (["--cache_lens", "1024"], 1024),
    (["--cache_lens", "1024", "--backend_type", "ktransformers"], 1024),
    (["--backend_type", "ktransformers"], 2048),  # the model's max positions
    ([], 2048),  # the batching pool: the model's max positions, below the default pool
])
def test_start_refused_when_the_kv_cache_of_its_context_would_not_fit(capsys, tiny_dir, tmp_path, monkeypatch,
                                                                      argv, tokens):
    mem = _memory(tiny_dir, tokens)
    assert mem.kv_cache > 0
    monkeypatch.delenv("KT_IGNORE_MEMORY_PLAN", raising=False)
    # room for the weights and half the KV cache of the server's context
    monkeypatch.setattr(importlib.import_module("ktransformers.kernels.pool"), "free_host_bytes",
                        lambda: mem.copies + mem.kv_cache // 2)
    rc, last = _start(capsys, tiny_dir, tmp_path, monkeypatch, *argv)
    assert rc == 2 and last.startswith("error: ") and f"KV cache at {tokens} tokens" in last
    assert "KT_IGNORE_MEMORY_PLAN=1" in last


def test_context_counted_is_the_one_the_server_serves(tiny_dir):
    cfg = load_config(tiny_dir)
    assert planned_context(parse_settings(["--model_path", str(tiny_dir)]), cfg) == cfg.max_position_embeddings
    assert planned_context(parse_settings(["--model_path", str(tiny_dir), "--cache_lens", "64",
                                           "--backend_type", "ktransformers"]), cfg) == 64
    cfg.max_position_embeddings = 10**6  # the batching pool stops at its default size
    from ktransformers.server.settings import DEFAULT_POOL_TOKENS

    assert planned_context(parse_settings(["--model_path", str(tiny_dir)]), cfg) == DEFAULT_POOL_TOKENS


def test_a_pool_past_the_model_positions_is_planned_at_them_not_refused(capsys, tiny_dir, tmp_path, monkeypatch):
    """A --cache_lens above the model's max positions (a batching pool several requests share) is
    sized at the model's positions in the plan, not refused as a context the model cannot hold."""
    cfg = load_config(tiny_dir)
    assert planned_context(parse_settings(["--model_path", str(tiny_dir), "--cache_lens", "100000"]), cfg) \
        == cfg.max_position_embeddings
    monkeypatch.delenv("KT_IGNORE_MEMORY_PLAN", raising=False)
    with pytest.raises(AssertionError, match="the server started"):
        _start(capsys, tiny_dir, tmp_path, monkeypatch, "--cache_lens", "4096")
