"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) through the shipped rules: MLA with the
DeepSeek sparse-attention indexer keeps its transformers forward (the indexer's keys in the cache next
to the latent KV; GLM-5's "shared" layers reuse the previous layer's top-k), its projections on
KLinearCPU; routed experts on every expert backend, against the unmodified transformers model.
fp32 parity of the shipped CPU rules (the indexer choosing its own top-k) runs in
tests/generation/test_parity.py.

The indexer's top-k keys and the router's top-k experts are discrete choices: at bf16 precision
transformers' own model picks other keys and experts than its fp32 run (its bf16 logits are 31 % /
40 % off its fp32 ones on these tiny models), and two bf16 models each choosing for itself differ by
those flips (up to 30 %), not by the operators.  The bf16 and quantized-backend checks here replay the
reference's choices into ours (the attention, the experts' arithmetic and the rest are compared);
the fp32 checks let ours choose.  Measured on the tiny
models (max |Δ| relative to max |logit|, 24 tokens):

===============================  ==================  ==================
rules / backend                  deepseek_v32        glm_moe_dsa
===============================  ==================  ==================
-cpu (llamafile F32)             6.6e-7              5.8e-7
KExpertsTorch                    7.6e-7              5.8e-7
AMXBF16 (choices replayed)       1.5e-3              1.6e-3
AMXInt8 (choices replayed)       8.7e-3              8.4e-3
bf16 model (choices replayed)    6.1e-3              4.8e-3
===============================  ==================  ==================

GGUF: llama.cpp's ``deepseek32`` / ``glm-dsa`` (the ``deepseek2`` MLA names and keys plus the
indexer's ``indexer.*`` tensors and ``attention.indexer.*`` keys; GLM-5's per-layer indexer types),
written by this project's converter exactly as llama.cpp's own converter writes them (its F32
files in tests/fixtures/llamacpp, whose logits tests/weights/test_llamacpp_fixtures.py checks):
F32 4.7e-7 / 3.9e-7; Q8_0 through the shipped rules vs the HF model on the dequantized file, mean /
median per-position max / max abs: 0.013 / 0.021 / 0.21 and 0.004 / 0.014 / 0.018.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ktransformers import load_model
from ktransformers.optimize_rules import RULES_DIR

from .family_checks import (BACKEND_SWAPS, assert_greedy_equal, assert_moe_block_on_cpu_kernels,
                            check_gpu_rules_cross_device_parity, check_our_converter_f32_and_q8, gguf_model_keys,
                            gguf_tensors, hf_on_gguf, load_with_picked_rules, model_with_backend, prompt_ids, rel_err)

# model_type -> (architecture, shipped rule stem, attention class)
FAMILIES = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32", "DeepseekV32Attention"),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsa", "GlmMoeDsaAttention"),
}
BF16_TOL = 2e-2  # as test_parity.py


def _choosers(model) -> list[torch.nn.Module]:
    """The modules making discrete choices, in call order: per layer the indexer (absent on GLM-5's
    layers reusing the previous top-k), then the router of a sparse layer."""
    out = []
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            out.append(layer.self_attn.indexer)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            out.append(layer.mlp.gate)
    return out


def _forward_with_reference_choices(model, hf, ids):
    """Both models' logits on ``ids``, ours with every indexer and router returning the reference's
    top-k (each called once per forward, in layer order)."""
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out)) for m in _choosers(hf)]
    try:
        with torch.no_grad():
            ref = hf(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    replay = iter(chosen)
    hooks = [m.register_forward_hook(lambda mod, args, out: next(replay)) for m in _choosers(model)]
    try:
        with torch.no_grad():
            got = model(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == len(_choosers(hf)) and next(replay, None) is None, "every recorded choice replayed"
    return got, ref


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.mark.parametrize("arch", FAMILIES)
def test_load_model_picks_the_family_rules(arch, tiny_model_dir):
    name, stem, attn_cls = FAMILIES[arch]
    cfg, model = load_with_picked_rules(tiny_model_dir(arch), name, stem)
    sparse = 0
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert type(attn).__name__ == attn_cls
        for leaf in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert getattr(attn, leaf).generate_op.name == "KLinearCPU", leaf
        if attn.indexer is not None:  # transformers' indexer, its projections plain
            assert type(attn.indexer.wq_b) is torch.nn.Linear and attn.indexer.wq_b.weight.device.type == "cpu"
        if cfg.mlp_layer_types[i] == "dense":
            assert layer.mlp.gate_proj.generate_op.name == "KLinearCPU"
            continue
        sparse += 1
        assert_moe_block_on_cpu_kernels(layer.mlp, "KMoEGate", "shared_experts.down_proj")
    assert sparse
    if arch == "glm_moe_dsa":  # a layer reusing the previous top-k is present
        assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, False, True]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_indexer_selects(arch, tiny_model_dir):
    """The tiny models' top-k is smaller than the prompts: the sparse selection changes the logits (so
    the fp32 parity covers it)."""
    d = tiny_model_dir(arch)
    ids = prompt_ids()
    with torch.no_grad():
        sparse = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(ids).logits
        dense = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, index_topk=ids.shape[1]).eval()(ids).logits
    assert sparse.shape == dense.shape and rel_err(sparse, dense) > 0.1


@pytest.mark.parametrize("backend", list(BACKEND_SWAPS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_expert_backends(arch, backend, tiny_model_dir):
    old, new, tol = BACKEND_SWAPS[backend]
    d = tiny_model_dir(arch)
    model = model_with_backend(d, RULES_DIR / f"{FAMILIES[arch][1]}-cpu.yaml", (old, new))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = prompt_ids(24, seed=3)
    if backend == "KExpertsTorch":  # exact: ours chooses its own top-k
        with torch.no_grad():
            assert rel_err(model(ids).logits, hf(ids).logits) <= tol
        assert_greedy_equal(model, hf, ids)
    else:
        got, ref = _forward_with_reference_choices(model, hf, ids)
        assert rel_err(got, ref) <= tol


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_close_to_hf_bf16_with_the_reference_choices(arch, tiny_model_dir):
    """Both models in bf16, ours on the reference's top-k keys and experts: logits within test_parity's bf16 bar and
    the greedy token agreeing (teacher-forced) wherever the reference's top-1 margin exceeds it."""
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    model = load_model(d, model_path=d, dtype=torch.bfloat16, allow_unmatched=False)
    prompt = prompt_ids()[:, :4]
    seq = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    got, ref = _forward_with_reference_choices(model, hf, seq)
    tol = BF16_TOL * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol
    ref_steps, got_steps = ref[0, prompt.shape[1] - 1 : -1], got[0, prompt.shape[1] - 1 : -1]
    top2 = ref_steps.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert clear.sum().item() >= 4
    want = seq[0, prompt.shape[1]:]
    assert all(got_steps[i].argmax() == want[i] for i in range(8) if clear[i])


@pytest.mark.parametrize("arch", FAMILIES)
def test_generator_carries_the_indexer_keys(arch, tiny_model_dir):
    """The project's engine (static cache, chunked prefill of 5 tokens, then decode): the indexer's
    key cache fills across the chunks and decode steps, the tokens equal transformers' greedy ones."""
    from ktransformers.generation import Generator, SamplingParams

    d = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    gen = Generator(load_model(d, model_path=d), tok, chunk_size=5)
    gen.eos_ids = set()
    ids = gen.apply_chat_template([{"role": "user", "content": "Hello there, how are you today?"}])
    ours = [e.token_id for e in gen.stream(ids, SamplingParams(max_new_tokens=16))][:-1]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


@pytest.mark.parametrize("arch", FAMILIES)
def test_continuous_batching_refuses_it_by_name(arch, tiny_model_dir, caplog):
    """The paged attention has no indexer: NotPageable naming it, and the server serves one request
    at a time."""
    from ktransformers.generation.paged import BatchRunner, NotPageable
    from ktransformers.server.engine import Engine
    from ktransformers.server.main import build_engine, parse_settings

    d = tiny_model_dir(arch)
    with pytest.raises(NotPageable, match=f"self_attn: {FAMILIES[arch][2]} has a sparse-attention indexer"):
        BatchRunner(load_model(d, model_path=d), page_size=4, num_pages=4)
    with caplog.at_level("WARNING", logger="ktransformers.server"):
        engine = build_engine(parse_settings(["--model_path", str(d), "--cache_lens", "512"]))
    assert type(engine) is Engine
    assert "continuous batching is not available for this model" in caplog.text
    assert "sparse-attention indexer" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
@pytest.mark.parametrize("arch", FAMILIES)
def test_gpu_rules_cross_device_parity(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    check_gpu_rules_cross_device_parity(d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())


@pytest.mark.parametrize("arch,gguf_arch", [("deepseek_v32", "deepseek32"), ("glm_moe_dsa", "glm-dsa")])
def test_gguf_from_our_converter(arch, gguf_arch, tiny_model_dir, tmp_path):
    """F32: the config (indexer included) comes back from the metadata alone and the logits match;
    Q8_0 through the shipped rules is close to the HF model on the dequantized file."""
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    keys = ("num_hidden_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim", "first_k_dense_replace", "n_shared_experts", "n_group", "topk_group",
                "routed_scaling_factor", "norm_topk_prob", "index_n_heads", "index_head_dim", "index_topk",
                "rope_parameters", "mlp_layer_types") + (("indexer_types",) if arch == "glm_moe_dsa" else ())
    src = check_our_converter_f32_and_q8(d, hf, tmp_path, keys)
    assert src.metadata["general.architecture"] == gguf_arch


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_converter_writes_llama_cpps_file(arch, tmp_path):
    """The HF model read back from llama.cpp's own file (tests/fixtures/llamacpp, F32), converted by
    ours: the same tensor names, types, shapes and values, and the same model metadata."""
    import gguf
    import numpy as np

    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / f"{arch}.gguf"
    hf_on_gguf(GGUFSource(fixture)).save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ours.gguf", "F32", "F32", "F32", tokenizer=False)
    assert gguf_tensors(out) == gguf_tensors(fixture)
    assert gguf_model_keys(out) == gguf_model_keys(fixture)
    ref = {t.name: np.array(t.data) for t in gguf.GGUFReader(fixture).tensors}
    for t in gguf.GGUFReader(out).tensors:
        np.testing.assert_array_equal(np.array(t.data), ref[t.name], err_msg=t.name)


def test_softmax_router_in_the_file_is_named(tmp_path):
    """A ``deepseek32`` file saying softmax routing (``expert_gating_func`` 1): the model only routes
    with sigmoid, so one error naming the key, not a model that silently routes otherwise."""
    from gguf_files import copy_gguf

    from ktransformers.errors import WeightError
    from ktransformers.weights.gguf_source import GGUFSource

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "deepseek_v32.gguf"
    out = copy_gguf(fixture, tmp_path / "softmax.gguf", keys={"deepseek32.expert_gating_func": 1})
    with pytest.raises(WeightError, match=r"'deepseek32\.expert_gating_func' is 1; .* sigmoid"):
        GGUFSource(out).config()


LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))  # a llama.cpp source tree (its gguf-py)
_LLAMA_NAMES = r"""
import re, sys
sys.path.insert(0, sys.argv[1])
import gguf
r = gguf.GGUFReader(sys.argv[2])
arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == sys.argv[3])
allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
bad = [t.name for t in r.tensors if re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name).rsplit(".", 1)[0] not in allowed]
keys = {gguf.Keys.Attention.Indexer.HEAD_COUNT, gguf.Keys.Attention.Indexer.KEY_LENGTH, gguf.Keys.Attention.Indexer.TOP_K}
missing = [k.format(arch=sys.argv[3]) for k in keys if k.format(arch=sys.argv[3]) not in r.fields]
print(bad, missing)
sys.exit(1 if bad or missing else 0)
"""


@pytest.mark.skipif(not (LLAMA_CPP / "gguf-py" / "gguf").is_dir(),
                    reason=f"llama.cpp's gguf-py not found under {LLAMA_CPP} (set KT_LLAMA_CPP_DIR)")
@pytest.mark.parametrize("arch,gguf_arch", [("deepseek_v32", "deepseek32"), ("glm_moe_dsa", "glm-dsa")])
def test_gguf_names_are_llama_cpps(arch, gguf_arch, tiny_model_dir, tmp_path):
    """Every tensor the converter writes is one llama.cpp's gguf-py lists for the architecture, and
    the indexer keys are its own (read in a separate process: its gguf-py, not the installed one)."""
    from ktransformers.convert import convert

    f = convert(tiny_model_dir(arch), tmp_path / "f32.gguf", "F32", "F32", "F32")
    r = subprocess.run([sys.executable, "-c", _LLAMA_NAMES, str(LLAMA_CPP / "gguf-py"), str(f), gguf_arch],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_fp8_release_loads_dequantized(tmp_path):
    """The FP8 block-quantized release format (as DeepSeek-V3's, test_deepseek_fp8.py): the shipped
    rules take the linears and experts dequantized at load and match the HF model on the
    dequantized weights."""
    from ktransformers.util.tiny_models import write_tiny_model

    from tests.weights._util import write_fp8_release

    src, fp8, deq = tmp_path / "bf", tmp_path / "fp8", tmp_path / "deq"
    # 128x128 scale blocks: sizes past one block
    write_tiny_model("deepseek_v32", src, seed=7, with_tokenizer=False, hidden_size=160, intermediate_size=288,
                     moe_intermediate_size=144, q_lora_rank=136)
    qsd = write_fp8_release(src, fp8, deq)
    assert sum(k.endswith("_scale_inv") for k in qsd) > 20
    ref = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    model = load_model(fp8, model_path=fp8, allow_unmatched=False)
    ids = prompt_ids()
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) <= 1e-4
