"""LinearGroupKernel: linears sharing an input in one call.

Each member's block of the output equals that member's own LinearKernel output exactly (the
same kernels on the same quantised input; mixed activation formats in one group), and the
gated form equals act(gate) * up of those outputs within 1e-5 (the kernels' exp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from quant_ref import make_weights

import ktransformers.kernels as K


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def _linears(pool, types, n_in, outs, seed=0):
    rng = np.random.default_rng(seed)
    return [K.LinearKernel(pool, "llamafile", n_in, o, make_weights(t, (o, n_in), rng)[0], t)
            for t, o in zip(types, outs)]


@pytest.mark.parametrize("T", [1, 3, 20])
@pytest.mark.parametrize("types", [(QT.Q8_0, QT.Q8_0, QT.Q8_0), (QT.Q5_0, QT.Q4_K, QT.Q6_K), (QT.F32, QT.Q8_0, QT.BF16)])
def test_members_side_by_side(pool, types, T):
    lins = _linears(pool, types, 512, (200, 64, 40))  # 200: not a multiple of the row block
    group = K.LinearGroupKernel(lins)
    assert (group.in_features, group.out_features) == (512, 304)
    x = torch.randn(T, 512)
    out = torch.full((T, 304), float("nan"))
    group.forward(x, out)
    want = torch.cat([lin.forward(x) for lin in lins], dim=-1)
    assert torch.equal(out, want)


@pytest.mark.parametrize("glu,ref", [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_gated_pair(pool, glu, ref):
    gate, up = _linears(pool, (QT.Q5_0, QT.Q8_0), 256, (96, 96), seed=1)
    group = K.LinearGroupKernel([gate, up], glu=glu)
    assert group.out_features == 96
    x = torch.randn(2, 256)
    out = torch.empty(2, 96)
    group.forward(x, out)
    want = ref(gate.forward(x)) * up.forward(x)
    assert (out - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_bad_groups_are_named(pool):
    a, b = _linears(pool, (QT.Q8_0, QT.Q8_0), 256, (32, 64))
    (c,) = _linears(pool, (QT.Q8_0,), 512, (32,))
    with pytest.raises(ValueError, match="different sizes"):
        K.LinearGroupKernel([a, c])
    with pytest.raises(ValueError, match="two members of the same size"):
        K.LinearGroupKernel([a, b], glu="silu")
    with pytest.raises(ValueError, match="glu: expected one of"):
        K.LinearGroupKernel([a, a], glu="relu")
    with pytest.raises(TypeError, match="LinearKernel"):
        K.LinearGroupKernel([])
    group = K.LinearGroupKernel([a, b])
    with pytest.raises(ValueError, match="contiguous float32"):
        group.forward(torch.randn(1, 256, dtype=torch.float64), torch.empty(1, 96))
    with pytest.raises(ValueError, match="expected T x 256 and T x 96"):
        group.forward(torch.randn(1, 256), torch.empty(1, 95))
