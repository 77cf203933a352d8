"""MoETrainKernel (C++ forward with expert LoRA + backward) against the pure-torch oracle on the
same weights dequantized by gguf-py (an independent dequantizer).

Tolerances, max |error| relative to the largest reference value, per backend/type:
llamafile F32 and BF16 weights 1e-5 (same math in another order; measured <= 8e-7), BF16 1e-2
where the tier's BF16 kernel takes bf16 activations (AVX512-BF16: each forward input rounded to
bf16; measured 2.7e-3); llamafile
Q8_0 / Q4_K 3e-2 (the forward products take int8-quantized activations on the avx2 tier and up,
as for inference; the backward's products are fp32; measured <= 1.3e-2, and <= 8e-7 on the
scalar tier, which computes on fp32 activations); AMXBF16 1e-2 (weights repacked to bf16;
measured 2.4e-3); AMXInt8 4e-2 (weights requantized to int8 per row, int8 activations;
measured 1.6e-2).  The oracle uses the weights before the AMX repacking.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktransformers import kernels as K

from .sft_reference import experts_reference, rel_err, silu_glu

E, H, I, T, TOPK, R = 4, 256, 256, 24, 2, 4
SCALE = 2.0
CASES = {("llamafile", "F32"): 1e-5, ("llamafile", "BF16"): 1e-2 if K.activation_format("BF16") == "bf16" else 1e-5,
         ("llamafile", "Q8_0"): 3e-2,
         ("llamafile", "Q4_K"): 3e-2, ("AMXBF16", "F32"): 1e-2, ("AMXInt8", "F32"): 4e-2}


def _quant(w: torch.Tensor, t: str):
    """(kernel weight, gguf-py-dequantized float [rows, cols]) of w [E, rows, cols] stored as t."""
    a = np.ascontiguousarray(w.reshape(-1, w.shape[-1]).numpy(), dtype=np.float32)
    if t == "F32":
        return w.contiguous(), a
    if t == "BF16":
        b = w.bfloat16().contiguous()
        return b, b.float().reshape(a.shape).numpy()
    qt = gguf.GGMLQuantizationType[t]
    if t == "Q8_0":
        q = gguf.quants.quantize(a, qt)
    else:  # the project's K-quant converter (gguf-py has no Q4_K quantizer)
        from ktransformers import cpuinfer_ext

        q = np.empty((a.shape[0], K.row_bytes(t, a.shape[1])), np.uint8)
        cpuinfer_ext.quantize_rows(qt.value, a.ctypes.data, a.shape[0], a.shape[1], q.ctypes.data, 1)
    return torch.from_numpy(q.reshape(-1).copy()), gguf.quants.dequantize(q, qt).reshape(a.shape)


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu, dn = torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.05
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    w = torch.rand(T, TOPK, generator=g)
    lora = {"gate_up_proj": (torch.randn(R * E, H, generator=g) * 0.1, torch.randn(2 * I, R * E, generator=g) * 0.1),
            "down_proj": (torch.randn(R * E, I, generator=g) * 0.1, torch.randn(H, R * E, generator=g) * 0.1)}
    dout = torch.randn(T, H, generator=g)
    return gu, dn, x, ids, w, lora, dout


def _factors(A, B):
    return K.LoraFactors(A.view(E, R, -1), B.view(B.shape[0], R, E).permute(2, 0, 1), SCALE)


def _kernel_run(backend, t, recompute=False, ids_override=None, **act):
    """(out, dx, dw, {param: grad in PEFT layout}) from the C++ kernels; plus dequantized weights."""
    gu, dn, x, ids, w, lora, dout = _problem()
    if ids_override is not None:
        ids = ids_override
    (g_raw, g_dq), (u_raw, u_dq), (d_raw, d_dq) = _quant(gu[:, :I], t), _quant(gu[:, I:], t), _quant(dn, t)
    moe = K.MoEKernel(K.cpu_infer(2), backend, E, H, I, g_raw, u_raw, d_raw, t, t, t, **act)
    tk = K.MoETrainKernel(moe)
    fg, fd = _factors(*lora["gate_up_proj"]), _factors(*lora["down_proj"])
    out, saved = tk.forward(x, ids, w, fg, fd, save=not recompute)
    dx, dw, dAg, dBg, dAd, dBd = tk.backward(x, ids, w, dout, saved, fg, fd)
    grads = {"gate_up_proj.A": dAg.reshape(R * E, H), "gate_up_proj.B": dBg.permute(1, 2, 0).reshape(2 * I, R * E),
             "down_proj.A": dAd.reshape(R * E, I), "down_proj.B": dBd.permute(1, 2, 0).reshape(H, R * E)}
    dq = (torch.cat([torch.from_numpy(g_dq).view(E, I, H), torch.from_numpy(u_dq).view(E, I, H)], 1),
          torch.from_numpy(d_dq).view(E, H, I))
    return out, dx, dw, grads, dq


def _oracle(gate_up, down, ids=None, glu=silu_glu):
    _, _, x, ids0, w, lora, dout = _problem()
    ids = ids0 if ids is None else ids
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    params = {f"{n}.{ab}": t.clone().requires_grad_() for n, (A, B) in lora.items() for ab, t in (("A", A), ("B", B))}
    lr = {n: (params[f"{n}.A"], params[f"{n}.B"]) for n in lora}
    out = experts_reference(x, ids, w, gate_up, down, lr, SCALE, glu)
    out.backward(dout)
    return out.detach(), x.grad, w.grad, {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("backend,wtype", list(CASES))
def test_gradients_match_torch_oracle(backend, wtype):
    tol = CASES[(backend, wtype)]
    out, dx, dw, grads, (gu, dn) = _kernel_run(backend, wtype)
    ref_out, ref_dx, ref_dw, ref_grads = _oracle(gu, dn)
    assert rel_err(out, ref_out) <= tol
    assert rel_err(dx, ref_dx) <= tol
    assert rel_err(dw, ref_dw) <= tol
    for n, g in grads.items():
        assert rel_err(g, ref_grads[n]) <= tol, n


def _clamp_swiglu(alpha, limit):
    def glu(g, u):
        gc = g.clamp(max=limit)
        return (u.clamp(-limit, limit) + 1) * gc * torch.sigmoid(alpha * gc)
    return glu


def _clamp_silu(limit):
    def glu(g, u):
        return torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
    return glu


@pytest.mark.parametrize("act", ["gelu_tanh", "clamp_swiglu", "clamp_silu"])
def test_other_activations(act):
    """GELU(tanh) (Gemma-style), gpt-oss's clamped SwiGLU and DeepSeek-V4's clamped SiLU; limit 0.5
    so that the clamps bite."""
    kw = {"activation": act} if act == "gelu_tanh" else {"activation": act, "alpha": 1.702, "limit": 0.5}
    glu = {"gelu_tanh": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u,
           "clamp_swiglu": _clamp_swiglu(1.702, 0.5), "clamp_silu": _clamp_silu(0.5)}[act]
    out, dx, dw, grads, (gu, dn) = _kernel_run("llamafile", "F32", **kw)
    ref_out, ref_dx, ref_dw, ref_grads = _oracle(gu, dn, glu=glu)
    for got, ref in [(out, ref_out), (dx, ref_dx), (dw, ref_dw)] + [(g, ref_grads[n]) for n, g in grads.items()]:
        assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize("wtype", ["Q4_K", "F32"])
def test_recompute_equals_saved(wtype):
    a = _kernel_run("llamafile", wtype)
    b = _kernel_run("llamafile", wtype, recompute=True)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert all(torch.equal(a[3][n], b[3][n]) for n in a[3])


def test_empty_slots_and_unreached_experts():
    """ids -1 skip a slot (its dw is 0); an expert no token reaches gets zero LoRA grads."""
    _, _, _, ids, _, _, _ = _problem()
    ids = ids.clone()
    ids[ids == 3] = -1
    ids[0, 1] = -1
    out, dx, dw, grads, (gu, dn) = _kernel_run("llamafile", "F32", ids_override=ids)
    ref_out, ref_dx, ref_dw, ref_grads = _oracle(gu, dn, ids=ids)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(dx, ref_dx) <= 1e-5
    assert torch.all(dw[ids < 0] == 0) and rel_err(dw, ref_dw) <= 1e-5
    assert torch.all(grads["down_proj.A"].view(E, R, I)[3] == 0)
    assert torch.all(grads["gate_up_proj.B"].view(2 * I, R, E)[:, :, 3] == 0)


def test_bad_expert_id_is_an_index_error():
    gu, dn, x, ids, w, lora, dout = _problem()
    moe = K.MoEKernel(K.cpu_infer(2), "llamafile", E, H, I, gu[:, :I].contiguous(), gu[:, I:].contiguous(), dn,
                      "F32", "F32", "F32")
    bad = ids.clone()
    bad[2, 0] = E
    with pytest.raises(IndexError, match=r"expert id 4 at \[2, 0\]"):
        K.MoETrainKernel(moe).forward(x, bad, w)
    with pytest.raises(ValueError, match="gate_up lora A: expected shape"):
        K.MoETrainKernel(moe).forward(x, ids, w, K.LoraFactors(torch.zeros(E, R, H + 1), torch.zeros(E, 2 * I, R), 1.0))


_SCALAR_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.operators.test_sft_experts_kernel import _kernel_run
from ktransformers import kernels as K
assert K.isa_tier() == "scalar", K.isa_tier()
res = {{}}
for backend, t in {cases!r}:
    out, dx, dw, grads, _ = _kernel_run(backend, t)
    res[backend + "/" + t] = {{"dx": dx.tolist(), "dw": dw.tolist(), **{{n: g.tolist() for n, g in grads.items()}}}}
json.dump(res, open({out!r}, "w"))
"""


def test_scalar_tier_matches_native(tmp_path):
    """KT_ISA=scalar (lowest tier) and the native tier give the same gradients within the
    case's tolerance (the native quantized paths take int8 activations in the forward)."""
    root = str(Path(__file__).resolve().parents[2])
    cases = [("llamafile", "F32"), ("llamafile", "Q4_K"), ("AMXInt8", "F32")]
    out = tmp_path / "scalar.json"
    env = dict(os.environ, KT_ISA="scalar", PYTHONPATH=root)
    subprocess.run([sys.executable, "-c", _SCALAR_SCRIPT.format(root=root, cases=cases, out=str(out))],
                   check=True, env=env, cwd=root, timeout=600)
    scalar = json.loads(out.read_text())
    for backend, t in cases:
        _, dx, dw, grads, _ = _kernel_run(backend, t)
        s = scalar[f"{backend}/{t}"]
        tol = CASES[(backend, t)]
        assert rel_err(dx, torch.tensor(s["dx"])) <= tol
        assert rel_err(dw, torch.tensor(s["dw"])) <= tol
        for n, g in grads.items():
            assert rel_err(g, torch.tensor(s[n])) <= tol, (backend, t, n)
