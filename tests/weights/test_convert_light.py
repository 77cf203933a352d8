"""The converter's light path (no torch, no transformers) writes the same file as the transformers path.

For each model type of ``LIGHT_MODEL_TYPES`` a tiny folder is converted both ways and the two files must
be byte-identical; folders the light path cannot vouch for (rope scaling, extra or missing tensors,
fp8 weights) must go through transformers — same bytes, or the transformers path's named error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ktransformers.convert import LIGHT_MODEL_TYPES, convert
from ktransformers.errors import WeightError
from ktransformers.util.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
#: hidden 256 so the K-quants' 256-value rows fit the attention and expert matrices
WIDE = dict(hidden_size=256)


def _convert_both(folder: Path, tmp: Path, **kw) -> tuple[bytes, bytes, list[str]]:
    said: list[str] = []
    light = convert(folder, tmp / "light.gguf", log=said.append, **kw)
    slow = convert(folder, tmp / "slow.gguf", light=False, **kw)
    return light.read_bytes(), slow.read_bytes(), said


def _took_light(said: list[str]) -> bool:
    return any("light path" in s for s in said)


@pytest.mark.parametrize("arch", LIGHT_MODEL_TYPES)
@pytest.mark.parametrize("preset", ["Q4_K_M", None])
def test_light_path_writes_the_transformers_paths_bytes(tmp_path, arch, preset):
    write_tiny_model("mixtral" if arch == "mixtral" else arch if arch != "mistral" else "llama", tmp_path / "hf",
                     **WIDE)
    if arch == "mistral":  # a llama-shaped checkpoint under mistral's model type
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    kw = {"preset": preset} if preset else {"experts": "Q4_K", "attention": "Q8_0", "default": "Q6_K"}
    light, slow, said = _convert_both(tmp_path / "hf", tmp_path, **kw)
    assert _took_light(said), said
    assert light == slow


def _edit_config(folder: Path, **changes) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def test_hub_style_config_and_bf16_per_expert_checkpoint(tmp_path):
    """A config as older transformers wrote it (``num_experts``, ``rope_theta``) over a bfloat16
    checkpoint with one key per expert: still the light path, still the same bytes."""
    d = tmp_path / "hf"
    write_tiny_model("qwen3_moe", d, **WIDE)
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg["rope_parameters"]["rope_theta"]
    _edit_config(d, rope_parameters=None, rope_theta=theta, num_experts=cfg.pop("num_local_experts", 8),
                 num_local_experts=None)
    sd = load_file(str(d / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            base, n = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = v[e, :n].clone()
                out[f"{base}.{e}.up_proj.weight"] = v[e, n:].clone()
        elif k.endswith("experts.down_proj"):
            base = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}, str(d / "model.safetensors"))
    light, slow, said = _convert_both(d, tmp_path, preset="Q4_K_M")
    assert _took_light(said)
    assert light == slow


def test_rope_scaling_goes_through_transformers(tmp_path):
    d = tmp_path / "hf"
    write_tiny_model("llama", d, **WIDE)
    _edit_config(d, rope_parameters=None, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    light, slow, said = _convert_both(d, tmp_path, preset="Q8_0")
    assert not _took_light(said)
    assert light == slow


def test_a_tensor_the_model_does_not_have_goes_through_transformers(tmp_path):
    d = tmp_path / "hf"
    write_tiny_model("qwen3", d, **WIDE)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.2.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].clone()  # MTP-like
    save_file(sd, str(d / "model.safetensors"))
    light, slow, said = _convert_both(d, tmp_path, preset="Q8_0")
    assert not _took_light(said)
    assert light == slow


def test_a_missing_tensor_is_the_transformers_paths_named_error(tmp_path):
    d = tmp_path / "hf"
    write_tiny_model("qwen2", d, **WIDE)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.bias"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        convert(d, tmp_path / "out.gguf", preset="Q8_0")
    assert not (tmp_path / "out.gguf").exists()


def test_a_corrupt_safetensors_header_is_a_named_error(tmp_path):
    d = tmp_path / "hf"
    write_tiny_model("qwen3", d, **WIDE)
    f = d / "model.safetensors"
    f.write_bytes((10 ** 12).to_bytes(8, "little") + f.read_bytes()[8:])
    with pytest.raises(WeightError, match="model.safetensors: unreadable safetensors file"):
        convert(d, tmp_path / "out.gguf", preset="Q8_0")


def test_a_fresh_process_imports_neither_torch_nor_transformers(tmp_path):
    d = tmp_path / "hf"
    write_tiny_model("qwen3_moe", d, **WIDE)
    code = ("import sys; from ktransformers.convert import main; "
            f"rc = main(['--model_path', {str(d)!r}, '--output', {str(tmp_path / 'o.gguf')!r}, '--preset', 'Q4_K_M', "
            "'-q']); heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(rc, heavy); sys.exit(1 if rc or heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_pre_tokenizer_table_matches_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from ktransformers.weights.gguf_vocab import PRE_TOKENIZER_SPLITS

    for name, pattern in PRE_TOKENIZER_SPLITS.items():
        assert GGUF_PRE_TOKENIZER_SPLITS[name] == pattern, name
