"""An adapter on the inference path (rules with the CPU kernels), and training's refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ktransformers.errors import ConfigError
from ktransformers.optimize_rules import RULES_DIR
from ktransformers.sft.__main__ import main

from ._util import losses_of, write_config, write_trainable_tiny_model


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def attn_run(tmp_path_factory):
    """A short run with LoRA on q/v only (what the inference rules' linears can carry)."""
    folder = tmp_path_factory.mktemp("sft-attn")
    model = write_trainable_tiny_model(folder / "tiny-qwen3moe")
    out = folder / "attn"
    assert main([str(write_config(folder, model, out, lora_target="q_proj,v_proj", max_steps=30,
                                  learning_rate=2e-2, save_steps=100))]) == 0
    return folder, model, out


def _peft_logits(model_dir, adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        return pm(ids).logits


def test_attention_adapter_on_the_cpu_kernel_rules_matches_peft(attn_run):
    """Shipped inference rules: the q/k/v/o linears are KTransformersLinear on the CPU kernels;
    PEFT's LoRA layer wraps them through the loader's ``lora=``."""
    from ktransformers.operators.linear import KTransformersLinear
    from ktransformers.loading import load_for_generation

    _, model_dir, out = attn_run
    ids = torch.randint(0, 300, (1, 16))
    ref = _peft_logits(model_dir, out, ids)
    loaded = load_for_generation(model_dir, model_dir, RULES_DIR / "Qwen3Moe-cpu.yaml", device="cpu", lora=out)
    q = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, KTransformersLinear) and "default" in q.lora_A
    with torch.no_grad():
        got = loaded.model(ids).logits
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def test_local_chat_answers_with_the_adapter(attn_run):
    _, model_dir, out = attn_run
    r = subprocess.run([sys.executable, "-m", "ktransformers.local_chat", "--model_path", str(model_dir),
                        "--lora_path", str(out), "--prompt", "Peru?", "--max_new_tokens", "6",
                        "--temperature", "0", "--cpu_infer", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # the reference: PEFT's model on the unmodified transformers model, greedy, same chat template
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "Peru?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(out)).eval()
    ref = pm.generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    want = tok.decode(ref, skip_special_tokens=True)
    assert r.stdout.rstrip("\n") == want.rstrip("\n"), (r.stdout, want)
    assert want.startswith("Lima"), want  # what it was trained to answer
    bad = subprocess.run([sys.executable, "-m", "ktransformers.local_chat", "--model_path", str(model_dir),
                          "--lora_path", str(model_dir), "--prompt", "x"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("not a LoRA adapter "
                                                                                "(no adapter_config.json)")


def test_server_settings_take_lora_path(attn_run, tmp_path):
    from ktransformers.server.main import parse_settings

    _, model_dir, out = attn_run
    s = parse_settings(["--model_path", str(model_dir), "--lora_path", str(out)])
    assert s.lora_path == str(out)
    with pytest.raises(ConfigError, match="--lora_path .*: no such folder"):
        parse_settings(["--model_path", str(model_dir), "--lora_path", str(tmp_path / "none")])


def test_expert_adapter_trained_here_applies_on_the_inference_rules(tmp_path):
    """An adapter this project trained with expert LoRA applies through the shipped inference rules
    (KTransformersExperts on the CPU kernels) as PEFT applies it to the unmodified model."""
    from ktransformers.loading import load_model

    model_dir = write_trainable_tiny_model(tmp_path / "m")
    out = tmp_path / "o"
    assert main([str(write_config(tmp_path, model_dir, out, lora_target="experts", max_steps=3,
                                  learning_rate=5e-2))]) == 0
    m = load_model(model_dir, rules=RULES_DIR / "Qwen3Moe-cpu.yaml", lora=out)
    assert m.model.layers[0].mlp.experts.lora_config["targets"] == ["gate_up_proj", "down_proj"]
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, _peft_logits(model_dir, out, ids), atol=1e-3, rtol=1e-3)


def test_expert_adapter_on_experts_no_operator_carries_is_refused(tmp_path):
    """Experts kept as the transformers module cannot carry expert LoRA: one line that says what to
    use instead."""
    from ktransformers.sft.adapter import apply_adapter
    from ktransformers.loading import load_model

    model_dir = write_trainable_tiny_model(tmp_path / "m")
    out = tmp_path / "o"
    assert main([str(write_config(tmp_path, model_dir, out, lora_target="experts", max_steps=1))]) == 0
    rules = tmp_path / "r.yaml"
    text = (RULES_DIR / "Qwen3Moe-cpu.yaml").read_text()
    a = text.rindex("- match:", 0, text.index(r'mlp\\.experts$"'))
    rules.write_text(text[:a] + text[text.index("- match:", a + 1):])  # the experts rule left out
    m = load_model(model_dir, rules=rules)
    with pytest.raises(ConfigError, match="LoRA on experts .* cannot apply; replace it with KTransformersExperts"):
        apply_adapter(m, out)


def test_gradient_accumulation_equals_the_bigger_batch(tmp_path):
    model_dir = write_trainable_tiny_model(tmp_path / "m")
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([str(write_config(tmp_path, model_dir, a, max_steps=3, save_steps=100))]) == 0
    assert main([str(write_config(tmp_path, model_dir, b, max_steps=3, save_steps=100,
                                  per_device_train_batch_size=2, gradient_accumulation_steps=2))]) == 0
    # the same 4 examples per step (the epoch order is per example), weighted by response tokens
    torch.testing.assert_close(torch.tensor(losses_of(a)), torch.tensor(losses_of(b)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, needle", [
    (dict(lora_target="q_prj"), "lora_target: 'q_prj' names no linear module of this model; did you mean 'q_proj'?"),
    (dict(lora_target="experts", kt_optimize_rule=str(RULES_DIR / "Qwen3Moe-cpu.yaml")),
     "lora_target: LoRA on experts needs a training experts operator"),
    (dict(lora_dropout=0.1), "lora_dropout: PEFT's LoRA on expert parameters takes no dropout"),
    (dict(template="llama3"), "template: 'llama3' ends turns with"),
    (dict(kt_optimize_rule="/nonexistent.yaml"), "kt_optimize_rule: /nonexistent.yaml: no such rule file"),
    (dict(resume_from_checkpoint=True), "resume_from_checkpoint: no checkpoint in"),
])
def test_training_refusals_are_one_line(tmp_path, capsys, extra, needle):
    model_dir = write_trainable_tiny_model(tmp_path / "m")
    capsys.readouterr()
    cfg = write_config(tmp_path, model_dir, tmp_path / "o", max_steps=1, **extra)
    assert main([str(cfg)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and needle in err[0], err


def test_resume_with_another_config_is_refused(tmp_path, capsys):
    model_dir = write_trainable_tiny_model(tmp_path / "m")
    out = tmp_path / "o"
    assert main([str(write_config(tmp_path, model_dir, out, max_steps=2, save_steps=1))]) == 0
    capsys.readouterr()
    cfg = write_config(tmp_path, model_dir, out, max_steps=2, seed=8, resume_from_checkpoint=True)
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{cfg}:" in err and "seed: 8 differs from 7 in the checkpoint" in err, err
    assert main([str(write_config(tmp_path, model_dir, out, max_steps=2))]) == 2
    assert "already holds an adapter; set overwrite_output_dir" in capsys.readouterr().err


def test_shipped_training_rules_need_the_kernel_operator_or_train(tmp_path, capsys):
    """Without kt_optimize_rule the shipped training rules (KSFTExpertsCPU) are used; a build without
    that operator says which rule file to use instead."""
    from ktransformers.operators.registry import operators

    model_dir = write_trainable_tiny_model(tmp_path / "m")
    cfg = write_config(tmp_path, model_dir, tmp_path / "o", max_steps=10, save_steps=100, kt_optimize_rule=None)
    text = "".join(ln + "\n" for ln in cfg.read_text().splitlines() if not ln.startswith("kt_optimize_rule"))
    cfg.write_text(text)
    capsys.readouterr()
    rc = main([str(cfg)])
    if "KSFTExpertsCPU" not in operators():
        assert rc == 2 and "Qwen3Moe-sft-torch-cpu.yaml" in capsys.readouterr().err
        return
    assert rc == 0
    losses = losses_of(tmp_path / "o")
    assert losses[-1] < losses[0]
    ids = torch.randint(0, 300, (1, 16))
    from ktransformers.loading import load_model

    got = load_model(model_dir, rules=RULES_DIR / "sft" / "Qwen3Moe-sft-cpu.yaml", lora=tmp_path / "o")
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, _peft_logits(model_dir, tmp_path / "o", ids),
                                   atol=1e-3, rtol=1e-3)


def test_training_continues_an_existing_adapter(attn_run, tmp_path):
    folder, model_dir, out = attn_run
    trained = losses_of(out)
    again = tmp_path / "again"
    assert main([str(write_config(folder, model_dir, again, lora_target="q_proj,v_proj", max_steps=1,
                                  adapter_name_or_path=str(out), learning_rate=1e-6, save_steps=100))]) == 0
    first = losses_of(again)[0]
    assert first < trained[0] / 2 and abs(first - trained[-1]) < 0.5 * trained[0], (first, trained)
