"""The DeepSeek-family rule files: each explains cleanly (every rule matches something) on a
config of the real depth, and the multi-GPU files really place every layer on its GPU."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import ktransformers
from ktransformers.operators.attention import KDeepseekV2Attention
from ktransformers.operators.gate import KMoEGate
from ktransformers.optimize import build_model, plan_model
from ktransformers.optimize.__main__ import main as optimize_main
from ktransformers.util.tiny_models import tiny_config

RULES = Path(ktransformers.__file__).parent / "optimize_rules"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# family -> (arch, overrides giving the real layer count and structure at tiny width, split layer)
FAMILIES = {
    "DeepSeek-V2-Chat": ("deepseek_v2", dict(num_hidden_layers=60, q_lora_rank=16, topk_method="group_limited_greedy",
                                             n_group=4, topk_group=2), 30),
    "DeepSeek-V2-Lite-Chat": ("deepseek_v2", dict(num_hidden_layers=27, q_lora_rank=None), 14),
    "DeepSeek-V3-Chat": ("deepseek_v3", dict(num_hidden_layers=61, first_k_dense_replace=3), 30),
    "Kimi-K2": ("deepseek_v3", dict(num_hidden_layers=61, n_group=1, topk_group=1), 30),
    "Moonlight-16B-A3B": ("deepseek_v3", dict(num_hidden_layers=27, q_lora_rank=None, n_group=1, topk_group=1), 14),
}
VARIANTS = ["", "-cpu", "-multi-gpu"]


def family_config(family):
    arch, over, _ = FAMILIES[family]
    return tiny_config(arch, **over)


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_cfg")
    out = {}
    for fam in FAMILIES:
        d = root / fam
        family_config(fam).save_pretrained(d)
        out[fam] = d
    return out


def _explain(rule: Path, model_dir: Path) -> tuple[int, str, str]:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = optimize_main(["explain", str(rule), "--model_path", str(model_dir)])
    return rc, o.getvalue(), e.getvalue()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_explain_every_rule_matches(family, variant, config_dirs):
    rule = RULES / f"{family}{variant}.yaml"
    rc, out, err = _explain(rule, config_dirs[family])
    assert rc == 0, err
    assert "matches nothing" not in out
    assert "KDeepseekV2Attention" in out and "KMoEGate" in out


@pytest.mark.parametrize("variant", ["", "-cpu"])
def test_explain_fp8_variant(variant, config_dirs):
    rc, out, err = _explain(RULES / f"DeepSeek-V3-Chat-fp8-linear{variant}.yaml", config_dirs["DeepSeek-V3-Chat"])
    assert rc == 0, err
    assert "KLinearFP8" in out


def _layer_of(name: str):
    m = re.match(r"^model\.layers\.(\d+)(\.|$)", name)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_multi_gpu_split_takes_effect(family):
    cfg = family_config(family)
    split = FAMILIES[family][2]
    model = build_model(cfg)
    plan = plan_model(model, RULES / f"{family}-multi-gpu.yaml")
    assert not plan.unmatched_rules()
    seen = {0: 0, 1: 0}
    for name, p in plan.placements.items():
        layer = _layer_of(name)
        if layer is None:
            continue
        want = torch.device("cuda:1" if layer >= split else "cuda:0")
        if ".mlp.experts" in name:  # routed experts: CPU both phases, output back to the layer's GPU
            assert p.generate_device == p.prefill_device == torch.device("cpu"), name
            exp = p if p.rule is not None else plan.placements[p.from_ancestor]
            assert torch.device(exp.kwargs["out_device"]) == want, name
            continue
        assert p.generate_device == want, f"{name}: {p.generate_device}, expected {want}"
        assert p.prefill_device == want, f"{name}: {p.prefill_device}, expected {want}"
        seen[want.index] += 1
    assert seen[0] and seen[1]
    # every attention / router is injected, on its layer's GPU
    for i in range(cfg.num_hidden_layers):
        want = torch.device("cuda:1" if i >= split else "cuda:0")
        a = plan.placements[f"model.layers.{i}.self_attn"]
        assert a.operator is KDeepseekV2Attention and a.generate_device == want
        if i >= cfg.first_k_dense_replace:
            assert plan.placements[f"model.layers.{i}.mlp.gate"].operator is KMoEGate
    assert plan.placements["model.norm"].generate_device == torch.device("cuda:1")
    assert plan.placements["lm_head"].generate_device == torch.device("cuda:1")
    assert plan.placements["model.embed_tokens"].generate_device == torch.device("cpu")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_gpu_and_cpu_variants_place_attention(family):
    cfg = family_config(family)
    model = build_model(cfg)
    for variant, dev in (("", "cuda:0"), ("-cpu", "cpu")):
        plan = plan_model(model, RULES / f"{family}{variant}.yaml")
        for i in range(cfg.num_hidden_layers):
            p = plan.placements[f"model.layers.{i}.self_attn"]
            assert p.operator is KDeepseekV2Attention and p.generate_device == torch.device(dev)
            kv_b = plan.placements[f"model.layers.{i}.self_attn.kv_b_proj"]
            assert kv_b.operator is None  # kept dense for the absorb split


def test_multi_gpu_runs_on_cpu_with_devices_renamed(tmp_path):
    """The multi-GPU file's structure (per-layer placement, boundary hops, experts' out_device)
    works end to end: with both GPUs renamed to 'cpu' the model equals HF."""
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path / "m"
    ref = write_tiny_model("deepseek_v3", d, seed=2, num_hidden_layers=31, first_k_dense_replace=29)
    text = (RULES / "DeepSeek-V3-Chat-multi-gpu.yaml").read_text().replace("cuda:0", "cpu").replace("cuda:1", "cpu")
    model = ktransformers.load_model(d, model_path=d, rules=text, allow_unmatched=False)
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert (want - got).abs().max() <= 1e-4 * want.abs().max()
