"""The full-size bench models (bench/full_size.py) plan as the converter plans a checkpoint: every
shape at 2 layers, without writing a byte -- so a change to ``convert.plan`` that the bench's
stand-in checkpoint does not answer shows here, not at the start of a 20-minute bench run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "full_size.py"


def _full_size(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # as the script runs: bench/ on sys.path
    spec = importlib.util.spec_from_file_location("bench_full_size", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["qwen3moe-30b-a3b", "deepseek-v2-lite"])
def test_every_shape_plans_its_layers_and_no_mtp_layer(shape, monkeypatch):
    fs = _full_size(monkeypatch)
    cfg, arch, outs = fs.plan_model(shape, 2)
    names = [o.name for o in outs]
    layers = {n.split(".")[1] for n in names if n.startswith("blk.")}
    assert layers == {"0", "1"}, f"{shape}: layers {sorted(layers)}"
    assert not any("nextn" in n for n in names), f"{shape}: an MTP layer was planned"
    writable = {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "F32"}
    assert {o.ggml_type for o in outs} <= writable, f"{shape}: types the random-block writer lacks"
    assert arch == fs.SHAPES[shape][1]
