"""DeepSeek-V4 (``deepseek_v4``) through the shipped rules: the hyper-connections around every layer,
the shared-KV attention with its CSA / HCA compressors, indexer and caches keep their transformers
forward (attention projections on KLinearCPU); the MoE block is KMoEBlock with the model's own routers
(the hash router reads the token ids the decoder layer passes the block); routed experts, whose gate /
up are clamped before the activation (silu(min(gate, limit)) * clamp(up, +-limit), the kernels'
``clamp_silu``), run on every expert backend, against the unmodified transformers model.  fp32 / bf16
parity of the shipped CPU rules runs in tests/generation/test_parity.py (the tiny config, whose
swiglu_limit makes the clamps bite, is in TINY_CONFIGS).  Measured on the tiny model (max |Δ| relative
to max |logit|, 24 tokens):

============================  ======================================================
rules / backend               logits
============================  ======================================================
DeepSeek-V4-cpu (llamafile)   4.9e-7, 16 greedy tokens identical
KExpertsTorch                 4.9e-7, 16 greedy tokens identical
AMXBF16                       8.8e-4
AMXInt8                       4.7e-3
bf16 model (llamafile)        7.8e-3 (avx2 tier 6.8e-3) vs transformers in bf16 (test_parity's 2e-2);
                              transformers' own bf16 run is 9.2e-3 off its fp32 run
============================  ======================================================

Checkpoints: the release's names (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn``, no
``model.`` prefix) and the module names both load.  The release's format (FP8 linears, FP4 experts,
E8M0 ``.scale`` tensors): linears dequantized at load, experts as MXFP4 on the CPU kernels, 2.7e-3
(avx512 / avx2 tiers, whose MXFP4 products take int8-quantized activations; 4.6e-7 on the scalar
tier) and KExpertsTorch 4.6e-7 against transformers' model on the weights its own dequantizer gives.  GGUF: llama.cpp's ``deepseek4`` architecture, read and written (tests/operators/test_deepseek_v4_gguf.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.optimize_rules import RULES_DIR, default_rule_file

from .family_checks import (BACKEND_SWAPS, assert_server_serves_one_at_a_time, check_expert_backend,
                            check_gpu_rules_cross_device_parity, generator_greedy, model_with_backend, prompt_ids,
                            rel_err)

ARCH = "deepseek_v4"
CPU_RULES = RULES_DIR / "DeepSeek-V4-cpu.yaml"
BACKENDS = {"llamafile": ("", "", 1e-4), **BACKEND_SWAPS}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hf: the shared fixture (conftest.py)


@pytest.fixture(scope="module")
def ours(tiny_model_dir):
    d = tiny_model_dir(ARCH)
    return load_model(d, model_path=d, allow_unmatched=False)


def test_load_model_picks_the_deepseek_v4_rules(tiny_model_dir, hf, ours):
    cfg = hf.config
    assert cfg.architectures == ["DeepseekV4ForCausalLM"]
    assert default_rule_file(cfg, cuda=False) == CPU_RULES
    assert default_rule_file(cfg, cuda=True) == RULES_DIR / "DeepSeek-V4.yaml"
    routers = set()
    for i, layer in enumerate(ours.model.layers):
        attn = layer.self_attn
        assert type(attn).__name__ == "DeepseekV4Attention"
        assert type(attn.compressor).__name__ == ("DeepseekV4CSACompressor" if cfg.layer_types[i] ==
                                                  "compressed_sparse_attention" else "DeepseekV4HCACompressor")
        for leaf in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            assert getattr(attn, leaf).generate_op.name == "KLinearCPU", leaf
        assert type(attn.o_a_proj).__name__ == "DeepseekV4GroupedLinear"  # grouped: its own forward
        assert type(layer.attn_hc).__name__ == type(layer.ffn_hc).__name__ == "DeepseekV4HyperConnection"
        assert type(layer.mlp).__name__ == "KMoEBlock"
        routers.add(type(layer.mlp.gate).__name__)
        assert (type(layer.mlp.gate).__name__ == "DeepseekV4HashRouter") == (cfg.mlp_layer_types[i] == "hash_moe")
        op = layer.mlp.experts.generate_op
        assert op.name == "KExpertsCPU" and op.backend == "llamafile" and op.activation == "clamp_silu"
        assert op.limit == cfg.swiglu_limit
        assert layer.mlp.shared_experts.up_proj.generate_op.name == "KLinearCPU"
    assert routers == {"DeepseekV4HashRouter", "DeepseekV4TopKRouter"}
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} == set(cfg.layer_types)


def test_the_clamps_bite(hf):
    """The tiny model's experts' pre-activations pass the limit: without the clamp the logits differ."""
    import copy

    ids = prompt_ids(24, seed=3)
    loose = copy.deepcopy(hf)
    for layer in loose.model.layers:
        layer.mlp.experts.limit = 1e9
    with torch.no_grad():
        assert rel_err(loose(ids).logits, hf(ids).logits) > 1e-2


def test_hash_routed_block_gets_the_token_ids(hf, ours):
    """The placed hash-routed block equals the model's for the same token ids, the ids choose its
    experts, and a call without them is refused naming the router."""
    i = hf.config.mlp_layer_types.index("hash_moe")
    ref_block, block = hf.model.layers[i].mlp, ours.model.layers[i].mlp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 7, hf.config.hidden_size, generator=g)
    ids = torch.randint(0, 300, (1, 7), generator=g)
    with torch.no_grad():
        got, ref = block(x, input_ids=ids), ref_block(x, input_ids=ids)
        other = block(x, input_ids=(ids + 1) % 300)
    assert rel_err(got, ref) <= 1e-5
    assert rel_err(other, ref) > 1e-2
    with pytest.raises(ValueError, match=r"mlp: DeepseekV4HashRouter routes by token id and got no input_ids"):
        block(x)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_expert_backends(backend, tiny_model_dir, hf):
    old, new, tol = BACKENDS[backend]
    check_expert_backend(model_with_backend(tiny_model_dir(ARCH), CPU_RULES, (old, new)), hf, tol)


def _release_tensors(d) -> dict[str, torch.Tensor]:
    """The tiny checkpoint under the release's key names (save_pretrained writes them with a ``model.``
    prefix, the release without: ``layers.0.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``)."""
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as h:
        saved = {k: h.get_tensor(k) for k in h.keys()}
    assert "model.layers.0.hc_attn_fn" in saved  # save_pretrained writes the release names
    top = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    release = {top.get(k, k.removeprefix("model.")): v for k, v in saved.items()}
    assert {"layers.0.attn.wq_a.weight", "norm.weight", "head.weight", "layers.1.ffn.experts.3.w1.weight"} <= set(release)
    return release


def _write_like(d, out, tensors, config_update=None):
    """``tensors`` as a model folder beside ``d``'s config and tokenizer files."""
    import json
    import shutil

    from safetensors.torch import save_file

    out.mkdir(exist_ok=True)
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    if config_update:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config_update)
        (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_release_names_load(tiny_model_dir, hf, tmp_path):
    """The release's key names map to the same modules as the module names."""
    d = tiny_model_dir(ARCH)
    out = _write_like(d, tmp_path / "release", _release_tensors(d))
    model = load_model(out, model_path=out, allow_unmatched=False)
    ids = prompt_ids(24, seed=3)
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fp8_release(w: torch.Tensor):
    """(float8_e4m3fn weight, E8M0 scale per 128 x 128 block): one block at the tiny sizes."""
    assert max(w.shape) <= 128
    e = torch.ceil(torch.log2(w.abs().max() / 448.0)).reshape(1, 1)
    return (w / torch.exp2(e)).to(torch.float8_e4m3fn), _e8m0(e)


def _fp4_release(w: torch.Tensor):
    """(int8 [rows, cols/2] e2m1 pairs, element 2j in the low nibble; E8M0 scale per 32 elements)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0))
    codes = ((g / torch.exp2(e)[..., None]).unsqueeze(-1) - _E2M1).abs().argmin(-1).to(torch.uint8)
    codes = codes.reshape(rows, cols // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8), _e8m0(e)


def test_fp8_fp4_release_loads(tiny_model_dir, tmp_path):
    """The release's format: FP8 (e4m3) linears with E8M0 128x128 block scales and FP4 (e2m1) routed
    experts with an E8M0 scale per 32, the scales as ``<name>.scale``.  The linears are dequantized at
    load, the experts go to the CPU kernels as MXFP4; against transformers' model on the weights
    dequantized by transformers' own FP8 / FP4 dequantizer."""
    import re

    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequant = Fp8Dequantize(None)._dequantize_one
    d = tiny_model_dir(ARCH)
    release, reference = {}, {}
    for k, t in _release_tensors(d).items():
        if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", k):
            q, s = _fp4_release(t)
        elif re.search(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$", k):
            q, s = _fp8_release(t)
        else:
            release[k] = reference[k] = t
            continue
        release[k], release[k.removesuffix(".weight") + ".scale"] = q, s
        reference[k] = dequant(q, s, torch.float32)
    assert sum(k.endswith(".scale") for k in release) == 3 * (5 + 3 + 3 * 8)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
             "expert_dtype": "fp4"}
    out = _write_like(d, tmp_path / "fp8", release, {"quantization_config": quant})
    ref = AutoModelForCausalLM.from_pretrained(_write_like(d, tmp_path / "deq", reference), dtype=torch.float32).eval()
    assert ref.model.layers[1].mlp.experts.gate_up_proj.abs().max() > 0
    ids = prompt_ids(24, seed=3)
    rules = CPU_RULES.read_text()
    for r, tol in ((rules, 3e-2), (rules.replace(*BACKEND_SWAPS["KExpertsTorch"][:2]), 1e-4)):
        model = load_model(out, model_path=out, rules=r, allow_unmatched=False)
        with torch.no_grad():
            assert rel_err(model(ids).logits, ref(ids).logits) <= tol
    assert model.model.layers[1].mlp.experts.generate_op.name == "KExpertsTorch"
    from ktransformers.weights import open_weights

    src = open_weights(out)  # what KExpertsCPU gets: the experts as ggml MXFP4 blocks, the linears dequantized
    assert src.raw("model.layers.1.mlp.experts.down_proj").ggml_type.name == "MXFP4"
    assert src.tensor("model.layers.1.self_attn.q_a_proj.weight").dtype == torch.float32


def test_our_converter_writes_it(tiny_model_dir, hf, tmp_path):
    """Our converter on the save_pretrained folder (the release's names): llama.cpp's deepseek4 layout
    (tests/operators/test_deepseek_v4_gguf.py holds it to llama.cpp's own file), loaded by the
    shipped rules in F32 within 1e-4 of transformers."""
    from ktransformers.convert import convert

    out = convert(tiny_model_dir(ARCH), tmp_path / "f32.gguf", "F32", "F32", "F32", tokenizer=False)
    model = load_model(out, model_path=tiny_model_dir(ARCH), allow_unmatched=False)
    ids = prompt_ids(24, seed=4)
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4


@pytest.mark.parametrize("chunk", [5, 64])
def test_generator_carries_the_compressed_caches(chunk, tiny_model_dir, hf, ours):
    """The project's engine (prefill in chunks of 5 tokens, so chunks end inside the compression
    windows of 4 and 8, then decode) on the model's own cache layers: the compressor state and
    compressed entries carry across the chunks, the tokens equal transformers' greedy ones."""
    got, ref = generator_greedy(ours, hf, tiny_model_dir(ARCH), chunk, min_prompt=3 * 8)
    assert got == ref


def test_continuous_batching_refuses_it_by_name(ours):
    from ktransformers.generation.paged import BatchRunner, NotPageable

    with pytest.raises(NotPageable, match=r"self_attn: DeepseekV4Attention compresses its KV \(DeepSeek-V4 CSA / HCA\)"):
        BatchRunner(ours, page_size=4, num_pages=4)


def test_server_falls_back_to_one_request_at_a_time(tiny_model_dir, caplog):
    assert_server_serves_one_at_a_time(tiny_model_dir(ARCH), caplog, "compresses its KV")


@pytest.mark.parametrize("stem", ["DeepSeek-V4", "DeepSeek-V4-cpu"])
def test_check_and_explain_the_shipped_rules(stem, hf):
    """Both files load as valid rules; ``explain`` on the tiny model places the routed experts on the
    CPU kernels in both, the attention projections and the MoE block on cuda:0 in the CPU+GPU file
    (how the CLI builds the view; tests/optimize/test_explain.py runs the CLI itself)."""
    from ktransformers.optimize import build_model, explain_plan, plan_model
    from ktransformers.optimize.rules import load_rules

    path = RULES_DIR / f"{stem}.yaml"
    assert load_rules(path)
    model = build_model(hf.config)
    plan = plan_model(model, path)
    assert not plan.unmatched_rules()
    rows = {r.module: r for r in explain_plan(model, plan).rows}
    dev = "cuda:0" if stem == "DeepSeek-V4" else "cpu"
    for i in range(hf.config.num_hidden_layers):
        assert rows[f"model.layers.{i}.mlp.experts"].generate == "cpu/KExpertsCPU"
        assert rows[f"model.layers.{i}.mlp"].generate == f"{dev}/KMoEBlock"
        assert rows[f"model.layers.{i}.self_attn.q_a_proj"].generate.startswith(f"{dev}/")
    assert rows["model"].generate == f"{dev}/default"  # attention, hyper-connections, caches: as placed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
def test_gpu_rules_cross_device_parity(tiny_model_dir, hf):
    check_gpu_rules_cross_device_parity(tiny_model_dir(ARCH), hf)  # picks DeepSeek-V4.yaml
