"""model_fingerprint: the same model gives the same id in any process; anything that changes a
page's K/V values (config, weight file, cache dtype) gives another."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from ktransformers.server.prefix_cache import model_fingerprint

from .conftest import REPO


def _fp_in_subprocess(model_dir) -> str:
    code = ("import sys; from ktransformers import load_model; "
            "from ktransformers.server.prefix_cache import model_fingerprint; "
            "d = sys.argv[1]; print(model_fingerprint(load_model(d + '/model.safetensors', d, device='cpu'), "
            "d + '/model.safetensors'))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_fingerprint_is_stable_across_processes(tiny, tiny_dir):
    model, _ = tiny
    fp = model_fingerprint(model, tiny_dir / "model.safetensors")
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert model_fingerprint(model, tiny_dir / "model.safetensors") == fp
    assert model_fingerprint(model, tiny_dir) == fp        # the folder holds the same single weight file
    assert _fp_in_subprocess(tiny_dir) == fp                # no ids or addresses leak into it


def test_fingerprint_changes_with_what_decides_the_kv(tiny, tiny_dir, tmp_path):
    model, _ = tiny
    fp = model_fingerprint(model, tiny_dir / "model.safetensors")
    assert model_fingerprint(model, tiny_dir / "model.safetensors", cache_dtype=torch.bfloat16) != fp
    other = tmp_path / "model.safetensors"                  # same name, other bytes
    shutil.copy2(tiny_dir / "model.safetensors", other)
    data = bytearray(other.read_bytes())
    data[-1] ^= 1                                            # a re-written weight file
    other.write_bytes(bytes(data))
    assert model_fingerprint(model, other) != fp
    old = model.config.rms_norm_eps
    try:
        model.config.rms_norm_eps = old * 2
        assert model_fingerprint(model, tiny_dir / "model.safetensors") != fp
    finally:
        model.config.rms_norm_eps = old
    plan = model.kt_plan
    try:
        del model.kt_plan                                    # other rules (here: none) give another id
        assert model_fingerprint(model, tiny_dir / "model.safetensors") != fp
    finally:
        model.kt_plan = plan
