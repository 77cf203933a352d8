"""``KExpertsCPU`` on a packed backend loads through the packed-weight cache: the first load packs
and writes each layer, the next maps them, with bitwise the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ktransformers import load_model
from ktransformers.operators.cpu_experts import KExpertsCPU
from ktransformers.optimize_rules import default_rule_file
from ktransformers.loading import load_config


@pytest.mark.parametrize("backend", ["AMXInt8", "AMXInt4"])
def test_second_load_maps_the_packed_experts(tiny_model_dir, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("KT_PACKED_CACHE", str(tmp_path / "cache"))
    d = tiny_model_dir("qwen3_moe")
    text = Path(default_rule_file(load_config(d, None), cuda=False)).read_text()
    assert "backend: llamafile" in text
    rules = text.replace("backend: llamafile", f"backend: {backend}")
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    logits, how = [], []
    for _ in range(2):
        model = load_model(d, model_path=d, rules=rules)
        ops = [m.generate_op for m in model.modules() if isinstance(getattr(m, "generate_op", None), KExpertsCPU)]
        assert ops
        how.append({op.packed_from for op in ops})
        with torch.inference_mode():
            logits.append(model(ids).logits)
    assert how == [{"packed+cached"}, {"mapped"}]
    assert len(list((tmp_path / "cache").rglob("*.ktpack"))) == len(ops)
    assert torch.equal(logits[0], logits[1])
