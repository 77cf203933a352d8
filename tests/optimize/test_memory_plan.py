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
from ktransformers.loading import check_memory_plan, load_config
from ktransformers.weights import open_weights

loading = importlib.import_module("ktransformers.loading.pipeline")


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


# ---- the KV cache, accelerators and the runtime -------------------------------------------------

def _held_kv_bytes(arch: str, tokens: int) -> int:
    """Bytes transformers' static cache of ``tokens`` holds once a forward has filled it."""
    import torch
    from transformers import StaticCache

    from ktransformers.util.tiny_models import random_model

    model = random_model(arch)
    cache = StaticCache(config=model.config, max_cache_len=tokens)
    with torch.no_grad():
        model(torch.arange(3)[None], cache=cache, use_cache=True)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe", "gpt_oss"])
def test_kv_cache_planned_as_transformers_allocates_it(arch):
    """Sliding-window layers hold their window, full layers the context: the plan's figure is the
    bytes the static cache allocates on the first forward."""
    from ktransformers.optimize.explain import kv_cache_bytes
    from ktransformers.util.tiny_models import tiny_config

    cfg = tiny_config(arch)
    model = build_model(cfg)
    plan = plan_model(model, default_rule_file(cfg, cuda=False), "cpu")
    tokens = 64
    assert (getattr(cfg, "sliding_window", None) or 0) < tokens  # a window, where there is one, is exercised
    assert kv_cache_bytes(model, plan, tokens) == {"cpu": _held_kv_bytes(arch, tokens)}


def test_mla_kv_cache_is_the_latent():
    from ktransformers.operators.mla import latent_cache_bytes_per_token
    from ktransformers.optimize.explain import kv_cache_bytes
    from ktransformers.util.tiny_models import tiny_config

    cfg = tiny_config("deepseek_v3")
    model = build_model(cfg)
    plan = plan_model(model, default_rule_file(cfg, cuda=False), "cpu")
    latent, _ = latent_cache_bytes_per_token(cfg, next(model.parameters()).dtype)
    assert kv_cache_bytes(model, plan, 100) == {"cpu": 100 * latent}


def test_chosen_context_counts_its_kv_cache(gguf, monkeypatch):
    model, plan, source, _ = _plan(gguf, "llamafile")
    reported = explain_plan(model, plan, source).memory
    assert reported.context == model.config.max_position_embeddings and not reported.context_chosen
    assert reported.kv_cache > 0 and reported.private == reported.copies  # reported, not in the peak
    assert any("KV cache up to" in ln for ln in reported.lines())
    chosen = explain_plan(model, plan, source, context=200).memory
    assert chosen.context == 200 and chosen.kv_cache == kv_cache_bytes_cpu(model, plan, 200)
    assert chosen.private == chosen.copies + chosen.kv_cache
    assert "KV cache at 200 tokens" in chosen.lines()[0]
    # room for the weights, not for the KV cache of 200 tokens: the chosen context is refused
    monkeypatch.setattr(importlib.import_module("ktransformers.kernels.pool"), "free_host_bytes",
                        lambda: chosen.copies + chosen.kv_cache // 2)
    check_memory_plan(model, plan, source)
    with pytest.raises(ConfigError, match="KV cache at 200 tokens"):
        check_memory_plan(model, plan, source, context=200)


def kv_cache_bytes_cpu(model, plan, tokens):
    from ktransformers.optimize.explain import kv_cache_bytes

    return kv_cache_bytes(model, plan, tokens)["cpu"]


def test_runtime_reported(gguf):
    mem = explain_plan(*_plan(gguf, "llamafile")[:3]).memory
    assert mem.runtime is not None and mem.runtime > 50 * 2**20  # torch alone is more
    assert "runtime (torch, transformers, CPU kernels: this process now)" in mem.lines()[0]


def test_accelerator_memory_planned_and_a_load_that_would_not_fit_refused(tiny_model_dir, monkeypatch):
    """The GPU rule file puts weights and the KV cache on cuda:0: the plan says how much, against the
    device's free memory, and the check refuses a load that would not fit there."""
    explain = importlib.import_module("ktransformers.optimize.explain")
    cfg = load_config(tiny_model_dir("qwen3_moe"))
    model = build_model(cfg)
    plan = plan_model(model, default_rule_file(cfg, cuda=True), "cuda:0")
    mem = explain_plan(model, plan, None, context=128).memory
    weights, kv, _ = mem.devices["cuda:0"]
    assert weights > 0 and kv == explain.kv_cache_bytes(model, plan, 128)["cuda:0"] > 0
    assert mem.kv_cache == 0  # attention on the GPU: no KV cache in host memory
    monkeypatch.setattr(explain, "_device_free", lambda dev: weights + kv - 1)
    line = next(ln for ln in explain_plan(model, plan, None, context=128).memory.lines() if "(cuda:0)" in ln)
    assert "does NOT fit" in line and explain.fmt_bytes(weights) in line
    check_memory_plan(model, plan, None)  # the KV cache of an unchosen context is not counted
    with pytest.raises(ConfigError, match=r"needs .* on cuda:0 and it has .* free"):
        check_memory_plan(model, plan, None, context=128)
    monkeypatch.setenv("KT_IGNORE_MEMORY_PLAN", "1")
    check_memory_plan(model, plan, None, context=128)


def test_loader_counts_the_context_it_is_given(gguf, monkeypatch):
    model, plan, source, _ = _plan(gguf, "llamafile")
    mem = explain_plan(model, plan, source, context=200).memory
    monkeypatch.setattr(importlib.import_module("ktransformers.kernels.pool"), "free_host_bytes",
                        lambda: mem.copies + mem.kv_cache // 2)
    said = []
    with pytest.raises(ConfigError, match="KV cache at 200 tokens"):
        loading.load_for_generation(gguf, context=200, log=said.append)
    assert any("KV cache at 200 tokens" in s for s in said)
    with pytest.raises(ConfigError, match="carries no tokenizer"):  # no context chosen: past the memory check
        loading.load_for_generation(gguf)
