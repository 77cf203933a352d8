"""The one ggml type table agrees with gguf-py and with the C++ kernels' own traits."""

from __future__ import annotations

import pytest
from gguf.constants import GGML_QUANT_SIZES

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K
from ktransformers.weights import ggml_types


def test_kernel_traits_agree_with_the_table():
    traits = ext.type_traits()
    assert traits, "the extension exports its type traits"
    for tid, name, be, bb, kernel in traits:
        t = ggml_types.TYPES[tid]
        assert (t.name, t.block_elems, t.block_bytes, t.kernel) == (name, be, bb, kernel)
        assert GGML_QUANT_SIZES[t.qtype] == (be, bb)
    assert ggml_types.BY_NAME["Q8_1"].block_bytes == 40 == dict((n, b) for _, n, _, b, _ in traits)["Q8_1"]
    assert set(K.TYPES) == {n for _, n, _, _, ok in traits if ok} == set(ggml_types.KERNEL_TYPES)


def test_a_disagreeing_kernel_table_is_refused_at_import(monkeypatch):
    real = ggml_types._kernel_traits()
    bad = dict(real)
    name, be, bb, ok = bad[9]
    bad[9] = (name, be, bb - 4, ok)  # Q8_1 with 36-byte blocks
    monkeypatch.setattr(ggml_types, "_kernel_traits", lambda: bad)
    with pytest.raises(ImportError, match=r"Q8_1 \(9\): the C\+\+ kernels say 32 elements / 36 bytes.*gguf-py says 32 / 40"):
        ggml_types._build()


def test_raw_tensor_carries_its_type_to_the_kernel(tmp_path):
    import numpy as np
    import torch

    from ktransformers.weights.source import RawTensor

    t = ggml_types.BY_NAME["Q8_0"]
    raw = RawTensor("w", np.zeros(t.nbytes((4, 64)), np.uint8), t, (4, 64))
    assert raw.ggml_type == 8 and raw.type is t and not raw.is_fp8
    k = K.LinearKernel(K.cpu_infer(1), "llamafile", 64, 4, raw.data, raw.type)
    assert k.type == "Q8_0"
    assert torch.equal(k.forward(torch.ones(1, 64)), torch.zeros(1, 4))
