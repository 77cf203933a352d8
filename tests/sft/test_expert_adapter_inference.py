"""An adapter with LoRA on the routed experts, applied where users run models: ``load_model(dir,
lora=)`` and the server's load sequence with the default inference rules, and the reference
system's fine-tuning rule files (``generate_op: KSFTExpertsCPU``) unmodified.

The reference is PEFT on the unmodified transformers model, the adapter written by PEFT itself
with random non-zero factors on the experts' fused parameters and on attention linears.  Tolerance:
the fine-tuning tests' 1e-3 on the logits (tiny fp32 model, F32 weights on the CPU kernels).
"""

from __future__ import annotations

import pytest
import torch

from ktransformers.errors import ConfigError
from ktransformers.optimize_rules import RULES_DIR

TOL = dict(atol=1e-3, rtol=1e-3)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def write_peft_adapter(model_dir, out, *, target_modules=None, target_parameters=EXPERT_PARAMS, r=4, alpha=8,
                       seed=1, **extra):
    """A PEFT adapter on the unmodified transformers model with every LoRA factor random (B too:
    PEFT's B starts at zero, which would hide a LoRA that is not applied)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                                       target_parameters=target_parameters, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(str(out))
    return out


def peft_model(model_dir, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def prompt(n, seed=3):
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, adapter on experts + q/v/o, adapter on experts only)."""
    from ktransformers.util.tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("expert-adapter")
    model_dir = root / "m"
    write_tiny_model("qwen3_moe", model_dir, seed=0)
    both = write_peft_adapter(model_dir, root / "both", target_modules=["q_proj", "v_proj", "o_proj"])
    experts = write_peft_adapter(model_dir, root / "experts", seed=2)
    return model_dir, both, experts


def _experts(model):
    from ktransformers.operators.experts import KTransformersExperts

    found = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert found and all(isinstance(m, KTransformersExperts) for m in found), [type(m) for m in found]
    return found


def test_expert_adapter_applies_with_the_default_rules_like_peft(tiny):
    """``load_model(dir, lora=)``, default (CPU) rules: KTransformersExperts on KExpertsCPU carries
    the expert LoRA beside the kernel; prompt (many tokens per expert) and single-token calls match
    PEFT's model."""
    from ktransformers.loading import load_model

    model_dir, both, _ = tiny
    ref = peft_model(model_dir, both)
    ids = prompt(40)
    with torch.no_grad():
        want = ref(ids).logits
        with ref.disable_adapter():
            plain = ref(ids).logits
    assert (want - plain).abs().max() > 0.1  # the adapter changes the answer: a skipped LoRA cannot pass
    model = load_model(model_dir, lora=both)
    experts = _experts(model)
    assert all(e.generate_op.name == "KExpertsCPU" and e.lora_config["targets"] == ["gate_up_proj", "down_proj"]
               for e in experts)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, **TOL)
        torch.testing.assert_close(model(ids[:, :1]).logits, want[:, :1], **TOL)


def test_server_load_sequence_greedy_tokens_match_peft(tiny):
    """The server's (and local_chat's) load sequence with the default rules; greedy answers through
    the Generator and the batching server's runner equal PEFT's ``generate``.  With LoRA on the
    experts only, the one decode step serves the model and hands the MoE blocks to their forward."""
    from ktransformers.generation import Generator
    from ktransformers.generation.decode_step import decode_step_for
    from ktransformers.generation.paged import BatchRunner
    from ktransformers.generation.sampling import SamplingParams
    from ktransformers.loading import load_for_generation

    model_dir, both, experts_only = tiny
    ids = prompt(12, seed=5)
    for adapter in (both, experts_only):
        ref = peft_model(model_dir, adapter)
        with torch.no_grad():
            want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                do_sample=False)[0, ids.shape[1]:].tolist()
        loaded = load_for_generation(model_dir, model_dir, device="cpu", lora=adapter)
        model = loaded.model
        assert all(e.lora_config is not None for e in _experts(model))
        if adapter is experts_only:
            step = decode_step_for(model)
            assert step is not None and all(lay.moe is None and lay.mlp_module is not None for lay in step.layers)
        gen = Generator(model, loaded.tokenizer)
        _, got, _ = gen.generate(ids[0].tolist(), SamplingParams(max_new_tokens=6, stop=[]))
        assert got == want[:len(got)] and len(got) >= 1, (got, want)
        runner = BatchRunner(model, page_size=4, num_pages=32)
        runner.begin(0)
        seq = [int(runner.step([(0, ids[0].tolist())])[0].argmax())]
        for _ in range(5):
            seq.append(int(runner.step([(0, [seq[-1]])])[0].argmax()))
        assert seq == want, (seq, want)


def test_torch_expert_op_applies_the_adapter(tiny, tmp_path):
    """KExpertsTorch (the prefill op of many rule files, any device) applies the same LoRA."""
    from ktransformers.loading import load_model

    model_dir, both, _ = tiny
    rules = (RULES_DIR / "Qwen3Moe-cpu.yaml").read_text().replace("generate_op: KExpertsCPU", "generate_op: KExpertsTorch")
    rules = rules.replace("      backend: llamafile", "")
    (tmp_path / "r.yaml").write_text(rules)
    model = load_model(model_dir, rules=tmp_path / "r.yaml", lora=both)
    assert {e.generate_op.name for e in _experts(model)} == {"KExpertsTorch"}
    ids = prompt(20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft_model(model_dir, both)(ids).logits, **TOL)


def test_int4_backend_refuses_expert_lora_in_one_line(tiny, tmp_path):
    from ktransformers.loading import load_model

    model_dir, _, experts_only = tiny
    rules = (RULES_DIR / "Qwen3Moe-cpu.yaml").read_text().replace("backend: llamafile", "backend: AMXInt4")
    (tmp_path / "r.yaml").write_text(rules)
    with pytest.raises(ConfigError) as e:
        load_model(model_dir, rules=tmp_path / "r.yaml", lora=experts_only)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.mlp.experts" in msg and "not backend AMXInt4" in msg, msg


def test_rslora_scale_follows_the_adapter(tiny, tmp_path):
    from ktransformers.loading import load_model

    model_dir, _, _ = tiny
    ad = write_peft_adapter(model_dir, tmp_path / "rs", use_rslora=True, r=8, alpha=4, seed=4)
    ids = prompt(16)
    with torch.no_grad():
        torch.testing.assert_close(load_model(model_dir, lora=ad)(ids).logits, peft_model(model_dir, ad)(ids).logits,
                                   **TOL)


# the reference system's fine-tuning rules for Qwen3-MoE (its class paths and kwarg spellings), with
# the devices set to the CPU; the experts' op is its trainable one, with one of its backends
REFERENCE_SFT_RULES = r"""
- match:
    class: ktransformers.models.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
  replace:
    class: ktransformers.operators.experts.KQwen3MoeSparseMoeBlockV2
    kwargs:
      generate_device: "cpu"
      prefill_device: "cpu"
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs:
      prefill_device: "cpu"
      prefill_op: "KExpertsTorch"
      generate_device: "cpu"
      generate_op: "KSFTExpertsCPU"
      out_device: "cpu"
      backend: "BACKEND"
  recursive: False
- match:
    name: "^model$"
  replace:
    class: "ktransformers.operators.models.KQwen3MoeModel"
    kwargs:
      per_layer_prefill_intput_threshold: 0
- match:
    name: "^model.embed_tokens"
  replace:
    class: "default"
    kwargs:
      generate_device: "cpu"
      prefill_device: "cpu"
"""


@pytest.mark.parametrize("backend", ["llamafile", "AMXInt8", "AMXBF16"])
def test_reference_sft_rules_load_unmodified_and_apply_the_adapter(tiny, tmp_path, backend):
    from ktransformers.kernels import isa_tier
    from ktransformers.optimize.explain import alias_lines
    from ktransformers.optimize.rules import parse_rules
    from ktransformers.loading import load_model

    model_dir, both, _ = tiny
    text = REFERENCE_SFT_RULES.replace("BACKEND", backend)
    lines = alias_lines(parse_rules(text, "Qwen3Moe-sft-amx.yaml"))
    assert any(ln.startswith("KSFTExpertsCPU → KExpertsCPU (") for ln in lines), lines
    notice = [ln for ln in lines if ln.startswith(f"backend: {backend} → ")]
    if backend == "llamafile" or isa_tier() == "amx":
        assert not notice, lines
    else:
        assert notice == [f"backend: {backend} → {backend} on the {isa_tier()} tier (this CPU has no AMX; the same "
                          "packed layout runs on its best kernels)"], lines
    (tmp_path / "ref.yaml").write_text(text)
    model = load_model(model_dir, rules=tmp_path / "ref.yaml", lora=both)
    experts = _experts(model)
    assert {(e.generate_op.name, e.generate_op.backend, e.prefill_op.name) for e in experts} == {
        ("KExpertsCPU", backend, "KExpertsTorch")}
    ref = peft_model(model_dir, both)
    # 80 tokens: past the prefill threshold (64), the torch op; 1 token: the CPU kernels
    ids = prompt(80)
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(model(ids).logits, want, **TOL)
        got = model(ids[:, :1]).logits
    if backend == "llamafile":
        torch.testing.assert_close(got, want[:, :1], **TOL)
    else:  # weights requantized (int8 per row) or rounded (bf16): the answer, not the bits
        assert int(got[0, -1].argmax()) == int(want[0, 0].argmax())
        assert (got - want[:, :1]).abs().max() < 0.05 * want[:, :1].abs().max()


def test_training_on_the_reference_sft_rules_names_the_operator_to_use(tmp_path, capsys):
    """Fine-tuning here trains expert LoRA through an operator's backward: rules naming
    ``KSFTExpertsCPU`` as an op (the inference op) are refused in one line that says so."""
    from ktransformers.sft.__main__ import main

    from ._util import write_config, write_trainable_tiny_model

    model_dir = write_trainable_tiny_model(tmp_path / "m")
    (tmp_path / "ref.yaml").write_text(REFERENCE_SFT_RULES.replace("BACKEND", "llamafile"))
    cfg = write_config(tmp_path, model_dir, tmp_path / "o", max_steps=1, lora_target="experts",
                       kt_optimize_rule=str(tmp_path / "ref.yaml"))
    capsys.readouterr()
    assert main([str(cfg)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "KSFTExpertsCPU or KSFTExpertsTorch as the rule's class" in err[0], err


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_adapter_on_other_moe_families_matches_peft(tmp_path, arch):
    """Mixtral (no shared expert) and Qwen2-MoE (a gated shared expert beside the routed ones), default rules."""
    from ktransformers.loading import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    write_tiny_model(arch, tmp_path / "m", seed=0)
    ad = write_peft_adapter(tmp_path / "m", tmp_path / "a", target_modules=["q_proj"])
    model = load_model(tmp_path / "m", lora=ad)
    assert all(e.lora_config is not None for e in _experts(model))
    ids = prompt(30)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft_model(tmp_path / "m", ad)(ids).logits, **TOL)
