"""The explain view for every shipped rule file against a tiny model of its family."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ktransformers.optimize import build_model, explain_plan, format_explanation, plan_model
from ktransformers.optimize_rules import DEFAULT_RULES, default_rule_file, shipped_rule_files
from ktransformers.util.tiny_models import tiny_config

# shipped file stem prefix -> tiny architecture of that family
FAMILY_ARCH = {
    "Qwen3Moe": "qwen3_moe", "Qwen2Moe": "qwen2_moe", "Mixtral": "mixtral", "DeepSeek-V3": "deepseek_v3",
    "Kimi-K2": "deepseek_v3", "Moonlight": "deepseek_v3", "DeepSeek-V2": "deepseek_v2", "Dense": "llama",
    "Glm4Moe": "glm4_moe", "Qwen3_5Moe": "qwen3_5_moe_text", "Qwen3Next": "qwen3_next",
    "DeepseekV32": "deepseek_v32", "GlmMoeDsa": "glm_moe_dsa", "DeepSeek-V4": "deepseek_v4",
    "MiniMaxM2": "minimax_m2", "GptOss": "gpt_oss", "Qwen3VLMoe": "qwen3_vl_moe",
    "Glm4vMoe": "glm4v_moe", "Ernie4_5_VLMoe": "ernie4_5_vl_moe",
}


# multi-GPU files split layers by number: build a model with the real layer count
REAL_LAYERS = {"DeepSeek-V3": 61, "Kimi-K2": 61, "Moonlight": 27, "DeepSeek-V2-Lite": 27, "DeepSeek-V2": 60}


def config_for(stem: str):
    overrides = {}
    if "multi-gpu" in stem:
        n = next(v for k, v in REAL_LAYERS.items() if stem.startswith(k))
        overrides["num_hidden_layers"] = n
    return tiny_config(arch_for(stem), **overrides)


def arch_for(stem: str) -> str:
    for prefix, arch in FAMILY_ARCH.items():
        if stem.startswith(prefix):
            return arch
    raise AssertionError(f"shipped rule file {stem}.yaml has no tiny model family in FAMILY_ARCH")


@pytest.mark.parametrize("path", shipped_rule_files(), ids=lambda p: p.stem)
def test_every_shipped_rule_file_matches_its_model(path):
    model = build_model(config_for(path.stem))
    plan = plan_model(model, path)
    assert not plan.unmatched_rules(), [r.where() for r in plan.unmatched_rules()]
    ex = explain_plan(model, plan)
    from ktransformers.optimize.inject import tied_weight_aliases

    tied = set(tied_weight_aliases(model))  # held once, with the tensor they are tied to
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)
                if n not in tied)
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rpartition(".")[2] not in model.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set)
    # every byte is placed somewhere (operators with a separate prefill copy count twice)
    assert sum(ex.bytes_per_device.values()) >= total
    text = format_explanation(ex)
    assert "prefill device/op" in text and "Parameter bytes per device" in text


def test_cpu_and_gpu_variants_place_experts_on_cpu():
    for stem in ("Qwen3Moe", "DeepSeek-V3-Chat"):
        for suffix in ("", "-cpu"):
            from ktransformers.optimize_rules import RULES_DIR

            arch = arch_for(stem)
            model = build_model(tiny_config(arch))
            plan = plan_model(model, RULES_DIR / f"{stem}{suffix}.yaml")
            experts = [p for n, p in plan.placements.items() if n.endswith("mlp.experts")]
            assert experts and all(p.generate_device == torch.device("cpu") for p in experts)
            attn = plan.placements["model.layers.0.self_attn"]
            assert attn.generate_device.type == ("cpu" if suffix else "cuda")


def test_default_rule_file_by_architecture():
    for arch_name, stem in DEFAULT_RULES.items():
        cfg = type("C", (), {"architectures": [arch_name]})()
        assert default_rule_file(cfg, cuda=False).name == f"{stem}-cpu.yaml"
        assert default_rule_file(cfg, cuda=True).name == f"{stem}.yaml"
        assert default_rule_file(cfg, cuda=False).is_file()


def test_explain_cli_table(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    r = subprocess.run([sys.executable, "-m", "ktransformers.optimize", "explain",
                        "ktransformers/optimize_rules/Qwen3Moe-cpu.yaml", "--model_path", str(d)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("model.layers.1.mlp.experts" in ln and "KTransformersExperts" in ln and "cpu/KExpertsCPU" in ln
               for ln in lines)
    assert any(ln.strip().startswith("#1") and "2 module(s)" in ln for ln in lines)
    assert "Parameter bytes per device: cpu:" in r.stdout


def test_explain_bytes_follow_devices():
    model = build_model(tiny_config("qwen3_moe"))
    rules = """
- match: {name: "experts$"}
  replace: {class: KTransformersExperts, kwargs: {generate_device: cpu, prefill_device: "cuda:0"}}
  recursive: false
"""
    ex = explain_plan(model, plan_model(model, rules))
    experts_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert ex.bytes_per_device["cuda:0"] == experts_bytes  # the prefill copy
    row = next(r for r in ex.rows if r.module == "model.layers.0.mlp.experts")
    assert row.bytes_per_device["cpu"] == row.bytes_per_device["cuda:0"] == experts_bytes // 2


def _tied_tiny_gemma(tiny_model_dir, tmp_path_factory, quant):
    from ktransformers.convert import convert

    out = tmp_path_factory.mktemp("tied") / f"g-{quant}.gguf"
    return convert(tiny_model_dir("gemma3_text"), out, quant, quant, quant, tokenizer=False)


@pytest.mark.parametrize("quant", ["Q8_0", "F32"])
def test_tied_embedding_counted_once(tiny_model_dir, tmp_path_factory, quant):
    """A tied head (no output.weight in the file) is the embedding's bytes: explain's total and the
    memory plan are the file's tensor bytes, not the embedding twice."""
    import gguf

    from ktransformers.weights import open_weights
    from ktransformers.weights.model_config import load_config

    path = _tied_tiny_gemma(tiny_model_dir, tmp_path_factory, quant)
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    source = open_weights(path)
    cfg = load_config(None, source)
    assert cfg.tie_word_embeddings
    model = build_model(cfg)
    ex = explain_plan(model, plan_model(model, default_rule_file(cfg, cuda=False), "cpu"), source)
    assert ex.bytes_per_device == {"cpu": stored}
    assert ex.memory.in_place + ex.memory.copies == stored
    assert "lm_head.weight is model.embed_tokens.weight (tied): counted once, under model.embed_tokens" in ex.notes
    head = next(r for r in ex.rows if r.module == "lm_head")
    assert head.bytes_per_device == {}


def test_tied_embedding_counted_once_without_weights(tiny_model_dir):
    """From a config alone (and from safetensors that store no head), the tied head is not counted again."""
    from ktransformers.weights import open_weights
    from ktransformers.weights.model_config import load_config

    d = tiny_model_dir("gemma3_text")
    for source in (None, open_weights(d)):
        cfg = load_config(d)
        model = build_model(cfg)
        ex = explain_plan(model, plan_model(model, default_rule_file(cfg, cuda=False), "cpu"), source)
        emb = model.model.embed_tokens.weight
        assert sum(r.bytes_per_device.get("cpu", 0) for r in ex.rows if r.module in ("lm_head", "model.embed_tokens")) \
            == emb.numel() * emb.element_size()


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(context=st.one_of(st.integers(-2**63, 2**63), st.integers(-2, 300)))
def test_fuzz_explain_context(tiny_model_dir, capsys, context):
    """Any --context: the memory plan at that many tokens, or one error line with the model's limit."""
    from ktransformers.optimize.__main__ import main

    d = tiny_model_dir("qwen3_moe")
    limit = tiny_config("qwen3_moe").max_position_embeddings
    rc = main(["explain", "ktransformers/optimize_rules/Qwen3Moe-cpu.yaml", "--model_path", str(d),
               f"--context={context}"])
    out, err = capsys.readouterr()
    if 1 <= context <= limit:
        assert rc == 0 and f"KV cache at {context} tokens" in out, err
    else:
        assert rc == 2 and err.strip() == (f"error: context of {context} tokens: expected 1 to {limit} "
                                           "(the model's max_position_embeddings)")
