"""The memory plan (``explain`` and the loader's first lines): what a load will hold in host
memory, decided before any weight is read, checked against what the load then holds."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from ktransformers import load_model
from ktransformers.errors import ConfigError
from ktransformers.operators.cpu_experts import KExpertsCPU
from ktransformers.optimize.explain import explain_plan
from ktransformers.optimize.inject import build_model
from ktransformers.optimize.plan import plan_model
from ktransformers.optimize_rules import default_rule_file
from ktransformers.util.loading import check_memory_plan, load_config
from ktransformers.weights import open_weights

loading = importlib.import_module("ktransformers.util.loading")


@pytest.fixture(scope="module")
def gguf(tiny_model_dir, tmp_path_factory):
    from ktransformers.convert import convert

    out = tmp_path_factory.mktemp("memplan") / "m.gguf"
    convert(tiny_model_dir("qwen3_moe"), out, "Q8_0", "Q8_0", "Q8_0", tokenizer=False)
    return out


def _plan(gguf, backend):
    source = open_weights(gguf)
    cfg = load_config(None, source)
    rules = Path(default_rule_file(cfg, cuda=False)).read_text().replace("backend: llamafile", f"backend: {backend}")
    model = build_model(cfg)
    plan = plan_model(model, rules, "cpu")
    return model, plan, source, rules


def _experts_raw_bytes(source, layers):
    return sum(source.raw(f"model.layers.{i}.mlp.experts.{p}").nbytes
               for i in range(layers) for p in ("gate_proj", "up_proj", "down_proj"))


def test_llamafile_experts_are_read_in_place(gguf):
    model, plan, source, _ = _plan(gguf, "llamafile")
    mem = explain_plan(model, plan, source).memory
    assert mem.packed == mem.packed_cached == 0
    assert mem.in_place >= _experts_raw_bytes(source, model.config.num_hidden_layers) > 0
    assert mem.private == mem.copies < mem.in_place


def test_packed_experts_planned_as_the_load_makes_them(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("KT_PACKED_CACHE", str(tmp_path / "cache"))
    model, plan, source, rules = _plan(gguf, "AMXInt8")
    before = explain_plan(model, plan, source).memory
    loaded = load_model(gguf, rules=rules)
    ops = [m.generate_op for m in loaded.modules() if isinstance(getattr(m, "generate_op", None), KExpertsCPU)]
    made = [op.kernel.packed_bytes for op in ops]
    assert before.packed == sum(made) and before.packed_layer == max(made) and before.packed_cached == 0
    assert before.private == before.copies + max(made)  # a cached first load keeps one layer private
    after = explain_plan(*_plan(gguf, "AMXInt8")[:3]).memory
    assert after.packed == 0 and after.packed_cached == sum(made)
    monkeypatch.setenv("KT_PACKED_CACHE", "0")
    off = explain_plan(*_plan(gguf, "AMXInt8")[:3]).memory
    assert off.private == off.copies + sum(made)


def test_a_load_that_would_not_fit_says_so_before_it_starts(gguf, monkeypatch):
    model, plan, source, _ = _plan(gguf, "llamafile")
    said = []
    check_memory_plan(model, plan, source, said.append)
    assert said and said[0].startswith("Memory plan (host):")
    monkeypatch.setattr(importlib.import_module("ktransformers.kernels.pool"), "free_host_bytes", lambda: 1024)
    with pytest.raises(ConfigError, match="private memory .* 1.00 KiB available"):
        check_memory_plan(model, plan, source)
    with pytest.raises(ConfigError, match="private memory"):
        loading.load_for_generation(gguf)
    monkeypatch.setenv("KT_IGNORE_MEMORY_PLAN", "1")
    check_memory_plan(model, plan, source)
