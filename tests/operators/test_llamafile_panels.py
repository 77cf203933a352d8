"""``KExpertsCPU`` with ``backend: llamafile_panels`` on a GGUF: the Q4_K experts are copied once
into 16-row panels (written to the packed-weight cache, mapped on the next load), the others read
in place, and the model's logits are bit for bit those of ``backend: llamafile``, at one token
and over a prompt.  ``explain``'s formats say which weights are packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ktransformers import cpuinfer_ext as ext
from ktransformers import load_model
from ktransformers.convert import convert
from ktransformers.loading import load_config
from ktransformers.weights import open_weights
from ktransformers.operators.cpu_experts import KExpertsCPU
from ktransformers.optimize_rules import default_rule_file
from ktransformers.util.tiny_models import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A tiny Qwen3-MoE whose experts can be Q4_K (hidden and expert FFN of 256), as a Q4_K_M GGUF:
    gate / up Q4_K, the down Q6_K in one layer and Q4_K in the other (llama-quantize's mix)."""
    d = tmp_path_factory.mktemp("panels")
    write_tiny_model("qwen3_moe", d / "hf", hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    out = convert(d / "hf", d / "m.gguf", preset="Q4_K_M")
    return out


def _rules(path, backend):
    text = Path(default_rule_file(load_config(None, open_weights(path)), cuda=False)).read_text()
    assert "backend: llamafile " in text
    return text.replace("backend: llamafile ", f"backend: {backend} ")


def test_same_bits_as_llamafile_and_cached(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("KT_PACKED_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = load_model(gguf, rules=_rules(gguf, "llamafile"))(ids).logits
    panels = ext.packed_rows()["llamafile_panels"][0] != "llamafile"
    how = []
    for _ in range(2):
        model = load_model(gguf, rules=_rules(gguf, "llamafile_panels"))
        ops = [m.generate_op for m in model.modules() if isinstance(getattr(m, "generate_op", None), KExpertsCPU)]
        assert ops
        how.append({op.packed_from for op in ops})
        fmts = {name: f.label for pl in model.kt_plan.placements.values()
                for name, f in pl.formats.get("generate", {}).items() if ".mlp.experts." in name}
        with torch.inference_mode():
            got = model(ids).logits
            one = model(ids[:, :1]).logits
        assert torch.equal(got, want)
        assert torch.equal(one, want[:, :1])
    if panels:  # a VNNI-512 tier: the Q4_K weights packed, the Q6_K down read in place
        assert how == [{"packed+cached"}, {"mapped"}]
        packed = "llamafile_panels packed from raw Q4_K"
        assert {v for k, v in fmts.items() if "gate" in k or "up_proj" in k} == {packed}
        assert sorted(v for k, v in fmts.items() if "down" in k) == [packed, "raw Q6_K"]
    else:  # elsewhere it is llamafile
        assert how == [{None}, {None}]
        assert set(fmts.values()) <= {"raw Q4_K", "raw Q6_K"}
