"""End to end on a tiny Qwen3-MoE: training lowers the loss, the adapter is PEFT's, resume is exact.

The reference for the adapter is PEFT itself on the unmodified transformers model
(``PeftModel.from_pretrained``); our side is the project's loader with ``lora=``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ktransformers.sft.__main__ import main
from ktransformers.sft.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

from ._util import KERNEL_RULES, SAVE, STEPS, TORCH_RULES, losses_of, write_config, write_trainable_tiny_model


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=["torch", "kernels"])
def run(request, tmp_path_factory):
    """One 50-step run with LoRA on attention and experts (checkpoint at step 25), with the experts in
    torch autograd and (where the build has the operator) on the CPU kernels' training path."""
    from ktransformers.operators.registry import operators

    rules = TORCH_RULES if request.param == "torch" else KERNEL_RULES
    if request.param == "kernels" and "KSFTExpertsCPU" not in operators():
        pytest.skip("KSFTExpertsCPU is not in this build")
    folder = tmp_path_factory.mktemp(f"sft-{request.param}")
    model = write_trainable_tiny_model(folder / "tiny-qwen3moe")
    out = folder / "run"
    n = torch.get_num_threads()
    assert main([str(write_config(folder, model, out, kt_optimize_rule=str(rules)))]) == 0
    torch.set_num_threads(n)
    return folder, model, out, rules


def test_fifty_steps_halve_the_loss(run):
    _, _, out, _ = run
    losses = losses_of(out)
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 <= losses[0] / 2, (losses[0], losses[-5:])
    assert (out / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / f"checkpoint-{SAVE}" / "trainer_state.pt").is_file()
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert (out / f).is_file()


def _peft_reference(model_dir, adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        base = hf(ids).logits
    pm = PeftModel.from_pretrained(hf, str(adapter))
    pm.eval()
    with torch.no_grad():
        return base, pm(ids).logits, pm


def test_adapter_loads_with_peft_into_the_unmodified_model(run):
    from ktransformers.loading import load_model

    _, model_dir, out, rules = run
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    ids = torch.randint(0, 300, (1, 16))
    base, ref, pm = _peft_reference(model_dir, out, ids)
    # PEFT wrapped whatever the adapter targets: the attention linears and the experts' fused parameters
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    wrapped = {n for n, m in pm.named_modules() if isinstance(m, LoraLayer)}
    assert any(n.endswith("self_attn.q_proj") for n in wrapped)
    if cfg.get("target_parameters"):
        assert any(isinstance(m, ParamWrapper) for m in pm.modules())
    assert (ref - base).abs().max() > 1e-2  # the trained adapter changes the output
    ours = load_model(model_dir, rules=rules, lora=out)
    with torch.no_grad():
        got = ours(ids).logits
    tol = 1e-4 if rules == TORCH_RULES else 1e-3  # the kernels sum in another order (fp32 weights here)
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_resume_from_the_middle_reproduces_the_run(run):
    folder, model_dir, out, rules = run
    out2 = folder / "resumed"
    cfg = write_config(folder, model_dir, out2, resume_from_checkpoint=str(out / f"checkpoint-{SAVE}"),
                       kt_optimize_rule=str(rules))
    assert main([str(cfg)]) == 0
    full, resumed = losses_of(out), losses_of(out2)
    assert len(resumed) == STEPS and resumed[:SAVE] == full[:SAVE]
    # same threads, same data order, restored optimizer/scheduler/RNG: the same numbers
    torch.testing.assert_close(torch.tensor(resumed[SAVE:]), torch.tensor(full[SAVE:]), atol=1e-6, rtol=0)
    from safetensors.torch import load_file

    a, b = load_file(str(out / ADAPTER_WEIGHTS)), load_file(str(out2 / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_export_merges_the_adapter_into_the_weights(run):
    from transformers import AutoModelForCausalLM

    folder, model_dir, out, rules = run
    merged = folder / "merged"
    cfg = write_config(folder, model_dir, out, export_dir=str(merged), do_train=False)
    assert main(["export", str(cfg)]) == 0
    ids = torch.randint(0, 300, (1, 12))
    _, ref, _ = _peft_reference(model_dir, out, ids)
    m = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    with torch.no_grad():
        got = m(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert (merged / "tokenizer_config.json").is_file()


def _saved_mib(stderr: str) -> float:
    import re

    m = re.search(r"saved activations of one micro-batch \(\d+ tokens\): ([\d.e+-]+) MiB", stderr)
    assert m, stderr[-2000:]
    return float(m.group(1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_gradient_checkpointing_same_run_less_saved_memory(arch, tmp_path, capsys):
    """Checkpointing on (``gradient_checkpointing: true``, and LLaMA-Factory's
    ``disable_gradient_checkpointing: false``) vs off: the CPU experts' Function runs again in
    the backward and gives the same losses and adapter (fp32: 1e-6), while autograd keeps less."""
    from ktransformers.operators.registry import operators
    from ktransformers.sft.model import SFT_RULES_DIR

    if "KSFTExpertsCPU" not in operators():
        pytest.skip("KSFTExpertsCPU is not in this build")
    rules = KERNEL_RULES if arch == "qwen3_moe" else SFT_RULES_DIR / "DeepSeek-V3-sft-cpu.yaml"
    model = write_trainable_tiny_model(tmp_path / "m", arch)
    runs = {}
    for name, extra in [("off", {}), ("on", dict(gradient_checkpointing=True)),
                        ("lf", dict(disable_gradient_checkpointing=False))]:
        out = tmp_path / name
        cfg = write_config(tmp_path, model, out, max_steps=6, save_steps=100, kt_optimize_rule=str(rules), **extra)
        assert main([str(cfg)]) == 0
        err = capsys.readouterr().err
        assert f"gradient checkpointing {'off' if name == 'off' else 'on'}" in err
        runs[name] = (losses_of(out), _saved_mib(err), out)
    from safetensors.torch import load_file

    off_losses, off_mib, off_out = runs["off"]
    for name in ("on", "lf"):
        losses, mib, out = runs[name]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(off_losses), atol=1e-6, rtol=0)
        a, b = load_file(str(off_out / ADAPTER_WEIGHTS)), load_file(str(out / ADAPTER_WEIGHTS))
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5)
        assert mib < 0.6 * off_mib, (mib, off_mib)


def test_gradient_checkpointing_keys_contradicting(tmp_path, capsys, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir("qwen3_moe"), tmp_path / "o", gradient_checkpointing=True,
                       disable_gradient_checkpointing=True)
    assert main([str(cfg)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "disable_gradient_checkpointing: true contradicts gradient_checkpointing: true (it is its inverse); "
        "give one of them")
