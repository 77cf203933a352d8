"""KSFTExpertsCPU inside whole injected models: one training step's gradients (expert LoRA,
router weight, input embeddings) and loss against the unmodified transformers model wrapped by
PEFT itself (``LoraConfig(target_parameters=[...])``) with the same LoRA values — torch autograd
on the dequantized weights.  This also checks that our LoRA parameters have PEFT's names,
shapes and expert layout: they are handed to PEFT through ``set_peft_model_state_dict``.

Tolerances (max |error| relative to the largest reference value of each tensor), measured in
brackets: llamafile on F32 weights 1e-4 [1.4e-6]; under gradient checkpointing the same;
bf16 autocast 5e-2 [1.7e-2]; AMXBF16 2e-2 [4.0e-3]; AMXInt8 5e-2 [1.7e-2]; llama.cpp's
Q4_K_M GGUF (Q4_K / Q6_K experts) 1e-4 on the scalar tier [3e-6] and 0.25 on tiers whose
forward takes int8 activations [LoRA 0.13, inputs 0.03].
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from ktransformers import kernels as K
from ktransformers import load_model
from ktransformers.kernels.moe_train import MoETrainKernel

from .sft_reference import rel_err

BLOCK = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE"}
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK, ALPHA = 4, 8


def sft_rules(arch: str, backend: str = "llamafile", extra: str = "") -> str:
    """MoE block -> KMoEBlock (DeepSeek router -> KMoEGate), experts -> KSFTExpertsCPU, rest torch."""
    r = (f'- match:\n    name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp$"\n    class: {BLOCK[arch]}\n'
         f"  replace:\n    class: KMoEBlock\n    device: cpu\n")
    if arch == "deepseek_v3":
        r += ('- match:\n    name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.gate$"\n'
              "  replace:\n    class: KMoEGate\n    device: cpu\n")
    r += ('- match:\n    name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.experts$"\n'
          f"  replace:\n    class: KSFTExpertsCPU\n    kwargs:\n      backend: {backend}\n{extra}  recursive: false\n"
          '- match:\n    name: "^model$"\n  replace:\n    class: default\n    device: cpu\n')
    return r


def sft_experts(model) -> dict:
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "KSFTExpertsCPU"}


def with_random_lora(model, peft_model, seed: int = 1, targets=TARGETS):
    """add_lora on every KSFTExpertsCPU with random A and B, the same values into the PEFT model."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, ex in sft_experts(model).items():
        ex.add_lora(RANK, ALPHA, 0.0, targets)
        ex.load_lora_state_dict({k: torch.randn(v.shape, generator=g) * 0.1 for k, v in ex.lora_state_dict().items()})
        sd.update({f"base_model.model.{name}.{k}": v.clone() for k, v in ex.lora_state_dict().items()})
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n or n.endswith("mlp.gate.weight"))  # LoRA and the router train
    res = set_peft_model_state_dict(peft_model, sd)
    assert not res.unexpected_keys
    missing_lora = [k for k in res.missing_keys if "lora_" in k]
    assert not missing_lora, missing_lora
    return sd


def step(model, vocab: int, autocast: bool = False, seed: int = 2):
    """(loss, grad of the input embeddings) of one step on fixed tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, 16), generator=g)
    labels = torch.randint(0, vocab, (1, 16), generator=g)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(inputs_embeds=emb, labels=labels).loss
    loss.backward()
    return loss.detach(), emb.grad


def peft_reference(hf, targets=TARGETS):
    pm = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_parameters=targets))
    for n, p in pm.named_parameters():
        if n.endswith("mlp.gate.weight"):
            p.requires_grad_(True)  # the router trains in both models
    return pm


def same_step(model, pm, tol: float, autocast: bool = False) -> dict:
    """One training step of ours and of the reference on the same batch: the losses within ``tol``
    relative, the input gradients within ``tol`` of max.  Returns the reference's parameters by name."""
    vocab = model.config.vocab_size
    loss, dx = step(model, vocab, autocast)
    ref_loss, ref_dx = step(pm, vocab)
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    assert rel_err(dx, ref_dx) <= tol
    return dict(pm.named_parameters())


def compare(model, pm, tol: float, autocast: bool = False) -> int:
    ref = same_step(model, pm, tol, autocast)
    n = 0
    for name, p in model.named_parameters():
        if "lora_" in name or name.endswith("mlp.gate.weight"):
            assert p.grad is not None, name
            assert rel_err(p.grad, ref[f"base_model.model.{name}"].grad) <= tol, name
            n += 1
    return n


def _moe_layers(model) -> int:
    return len(sft_experts(model))


@pytest.mark.parametrize("arch", list(BLOCK))
def test_gradients_match_peft_on_transformers(arch, tiny_model_dir, one_torch_thread):
    """Qwen3-MoE (softmax top-k), Qwen2-MoE (+ shared expert with its sigmoid gate), DeepSeek-V3
    (sigmoid router, grouped top-k, correction bias, shared expert, a dense first layer)."""
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d, rules=sft_rules(arch))
    pm = peft_reference(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    with_random_lora(model, pm)
    n = compare(model, pm, 1e-4)
    assert n == 5 * _moe_layers(model) > 0  # 4 LoRA factors + the router per MoE layer


@pytest.mark.parametrize("backend,tol", [("AMXBF16", 2e-2), ("AMXInt8", 5e-2)])
def test_packed_backends(backend, tol, tiny_model_dir, one_torch_thread):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen3_moe", backend))
    assert all(ex.generate_op.backend == backend for ex in sft_experts(model).values())
    pm = peft_reference(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    with_random_lora(model, pm)
    compare(model, pm, tol)


def test_gradient_checkpointing(tiny_model_dir, one_torch_thread, monkeypatch):
    """Checkpointed layers run the experts' forward again in the backward; same gradients."""
    calls = []
    orig = MoETrainKernel.forward
    monkeypatch.setattr(MoETrainKernel, "forward", lambda self, *a, **kw: calls.append(1) or orig(self, *a, **kw))
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen3_moe"))
    pm = peft_reference(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    with_random_lora(model, pm)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compare(model, pm, 1e-4)
    assert len(calls) == 2 * _moe_layers(model)


def test_recompute_kwarg_same_gradients(tiny_model_dir, one_torch_thread):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen3_moe", extra="      recompute: true\n"))
    assert all(ex.recompute for ex in sft_experts(model).values())
    pm = peft_reference(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    with_random_lora(model, pm)
    compare(model, pm, 1e-4)


def test_bf16_autocast(tiny_model_dir, one_torch_thread):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen3_moe"))
    pm = peft_reference(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32))
    with_random_lora(model, pm)
    compare(model, pm, 5e-2, autocast=True)


def test_llama_cpp_q4_k_gguf(fixtures_dir, one_torch_thread):
    """llama.cpp's Q4_K_M file: experts in Q4_K (one down_proj Q6_K) read in place; the
    reference is transformers' own GGUF loader (gguf-py dequantization) + PEFT."""
    d = fixtures_dir / "qwen3moe-tiny"
    model = load_model(d / "Q4_K_M.gguf", rules=sft_rules("qwen3_moe"))
    types = {t for ex in sft_experts(model).values() for t in ex.generate_op.kernel.types}
    assert types == {"Q4_K", "Q6_K"}
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file="Q4_K_M.gguf", config=AutoConfig.from_pretrained(d / "hf"),
                                              dtype=torch.float32)
    pm = peft_reference(hf)
    with_random_lora(model, pm)
    compare(model, pm, 1e-4 if K.isa_tier() == "scalar" else 0.25)


def test_only_down_proj_targeted(tiny_model_dir, one_torch_thread):
    """One target: its factors sit on the module itself, as PEFT's single ParamWrapper."""
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen3_moe"))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    pm = peft_reference(hf, ["mlp.experts.down_proj"])
    with_random_lora(model, pm, targets=["down_proj"])
    ex = model.model.layers[0].mlp.experts
    assert sorted(ex.lora_state_dict()) == ["lora_A.weight", "lora_B.weight"]
    compare(model, pm, 1e-4)


def test_frozen_experts_without_lora(tiny_model_dir, one_torch_thread):
    """No expert LoRA: the experts are a frozen function; gradients still reach the inputs and
    the router (Qwen2-MoE: shared expert and its sigmoid gate in torch beside them)."""
    d = tiny_model_dir("qwen2_moe")
    model = load_model(d, model_path=d, rules=sft_rules("qwen2_moe"))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    for m in (model, hf):
        for n, p in m.named_parameters():
            p.requires_grad_(n.endswith("mlp.gate.weight"))
    loss, dx = step(model, model.config.vocab_size)
    ref_loss, ref_dx = step(hf, model.config.vocab_size)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * ref_loss.item()
    assert rel_err(dx, ref_dx) <= 1e-4
    ref = dict(hf.named_parameters())
    grads = [(n, p.grad) for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(grads) == _moe_layers(model) > 0
    for n, g in grads:
        assert rel_err(g, ref[n].grad) <= 1e-4, n


MLA_LINEARS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _shipped_deepseek_v3_rules(backend: str) -> str:
    from ktransformers.sft.model import SFT_RULES_DIR

    text = (SFT_RULES_DIR / "DeepSeek-V3-sft-cpu.yaml").read_text()
    assert "backend: llamafile" in text
    return text.replace("backend: llamafile", f"backend: {backend}")


@pytest.mark.parametrize("backend,tol", [("llamafile", 1e-4), ("AMXBF16", 2e-2), ("AMXInt8", 5e-2)])
def test_deepseek_v3_shipped_rules_attention_and_experts(backend, tol, tiny_model_dir, one_torch_thread):
    """The shipped DeepSeek-V3 training rules (grouped top-k router, shared expert, MLA attention
    left to transformers) with PEFT's LoRA on the five MLA linears and ours on the routed experts:
    loss, input gradients and every LoRA gradient against PEFT on the unmodified model (fp32,
    dequantized) with the same LoRA values.  Tolerances as for Qwen3-MoE above; the worst tensor
    measured: llamafile on F32 weights [1.5e-6], AMXBF16 [4.0e-3], AMXInt8 [3.6e-2]."""
    from ktransformers.sft.adapter import PREFIX, expert_modules, lora_state_dict, wrap_linears

    d = tiny_model_dir("deepseek_v3")
    model = load_model(d, model_path=d, rules=_shipped_deepseek_v3_rules(backend))
    experts = expert_modules(model)
    assert len(experts) == 2 and all(ex.generate_op.backend == backend for ex in experts.values())
    assert type(model.model.layers[1].mlp.gate).__name__ == "KMoEGate"
    assert type(model.model.layers[1].self_attn).__name__ == "DeepseekV3Attention"
    model.requires_grad_(False)
    ours = wrap_linears(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MLA_LINEARS))
    for ex in experts.values():
        ex.add_lora(RANK, ALPHA, 0.0, TARGETS)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32),
                        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MLA_LINEARS, target_parameters=TARGETS))
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in lora_state_dict(model, ours).items()}
    assert sum(".self_attn." in k for k in sd) == 2 * len(MLA_LINEARS) * model.config.num_hidden_layers
    set_peft_model_state_dict(ours, sd)
    for name, ex in experts.items():
        ex.load_lora_state_dict({k[len(PREFIX) + len(name) + 1:]: v for k, v in sd.items()
                                 if k.startswith(f"{PREFIX}{name}.")})
    res = set_peft_model_state_dict(pm, sd)
    assert not res.unexpected_keys and not [k for k in res.missing_keys if "lora_" in k]
    ref = same_step(model, pm, tol)
    n = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = name if name in ref else f"{PREFIX}{name}"
            assert p.grad is not None, name
            assert rel_err(p.grad, ref[key].grad) <= tol, name
            n += 1
    assert n == len(sd)  # every LoRA tensor of the adapter, attention and experts
