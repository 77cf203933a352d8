"""Packed expert weights cached on disk (kernels/packed_cache.py).

A layer is packed once and written; later loads map the file.  Checked: the mapped kernel's
outputs are bitwise the packed-in-memory kernel's; a corrupt (one flipped byte), truncated or
stale (source file touched, another ISA tier, another layout version) file is detected, reported
and rebuilt, never used; a cache folder that cannot be written leaves the load working; the
cache can be turned off; ``prepacked`` of the wrong size or alignment is refused.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from quant_ref import make_weights

import ktransformers.kernels as K
import ktransformers.kernels.packed_cache as pc

E, H, I, TOPK = 4, 256, 256, 2


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(5)
    return tuple(make_weights(QT.Q4_K, s, rng)[0] for s in ((E, I, H), (E, I, H), (E, H, I)))


@pytest.fixture
def src(tmp_path):
    f = tmp_path / "model.gguf"  # the source identity: path, size, mtime
    f.write_bytes(b"GGUF" + bytes(100))
    return f


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("KT_PACKED_CACHE", str(d))
    return d


def _inputs(T=9):
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(T)]).astype(np.int64)
    w = rng.uniform(0.1, 1, (T, TOPK)).astype(np.float32)
    return x, ids, w


def _kernel(layer, src, backend="AMXInt8", key="model.layers.0.mlp.experts"):
    g, u, d = layer
    return pc.packed_moe(K.cpu_infer(2), backend, key, src, E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K)


def _files(cache):
    return sorted(cache.rglob("*.ktpack"))


@pytest.mark.parametrize("backend", ["AMXInt8", "AMXBF16", "AMXInt4", "AMXInt4_1", "llamafile_panels"])
def test_packed_once_then_mapped_with_the_same_outputs(layer, src, cache, backend):
    g, u, d = layer
    plain = K.MoEKernel(K.cpu_infer(2), backend, E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K)
    first, how1 = _kernel(layer, src, backend)
    second, how2 = _kernel(layer, src, backend)
    if plain.packed_bytes == 0:  # llamafile_panels on a tier without its kernel: in place, no file
        assert (how1, how2) == ("in place", "in place") and not _files(cache)
    else:
        assert (how1, how2) == ("packed+cached", "mapped")
        (f,) = _files(cache)
        assert f.stat().st_size == pc.HEADER + plain.packed_bytes
    x, ids, w = _inputs()
    want = plain.forward(x, ids, w)
    assert np.array_equal(first.forward(x, ids, w), want)
    assert np.array_equal(second.forward(x, ids, w), want)


def _corrupt(f):
    with open(f, "r+b") as fh:
        fh.seek(pc.HEADER + 1000)
        b = fh.read(1)
        fh.seek(pc.HEADER + 1000)
        fh.write(bytes([b[0] ^ 0x40]))


def _truncate(f):
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 64)


def _bad_magic(f):
    with open(f, "r+b") as fh:
        fh.write(b"XXXX")


@pytest.mark.parametrize("damage,why", [(_corrupt, "checksum mismatch"), (_truncate, "truncated"),
                                        (_bad_magic, "not a packed-weight file")])
def test_a_damaged_file_is_rebuilt_never_used(layer, src, cache, damage, why, caplog):
    _kernel(layer, src)
    (f,) = _files(cache)
    damage(f)
    with caplog.at_level(logging.WARNING, "ktransformers.packed_cache"):
        k, how = _kernel(layer, src)
    assert how == "packed+cached" and why in caplog.text
    g, u, d = layer
    x, ids, w = _inputs()
    plain = K.MoEKernel(K.cpu_infer(2), "AMXInt8", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K)
    assert np.array_equal(k.forward(x, ids, w), plain.forward(x, ids, w))
    assert _kernel(layer, src)[1] == "mapped"


def test_a_changed_source_or_tier_or_layout_is_stale(layer, src, cache, monkeypatch, caplog):
    assert _kernel(layer, src)[1] == "packed+cached"
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the source file changed
    assert _kernel(layer, src)[1] == "packed+cached"
    assert len(_files(cache)) == 2  # another source, another file
    monkeypatch.setattr(pc, "isa_tier", lambda: "avx2-other")
    with caplog.at_level(logging.WARNING, "ktransformers.packed_cache"):
        assert _kernel(layer, src)[1] == "packed+cached"
    assert "made for another tier" in caplog.text
    monkeypatch.setattr(pc, "LAYOUT_VERSION", pc.LAYOUT_VERSION + 1)
    assert _kernel(layer, src)[1] == "packed+cached"
    assert _kernel(layer, src)[1] == "mapped"


def test_layers_and_backends_get_their_own_files(layer, src, cache):
    _kernel(layer, src, key="model.layers.0.mlp.experts")
    _kernel(layer, src, key="model.layers.1.mlp.experts")
    _kernel(layer, src, backend="AMXInt4", key="model.layers.1.mlp.experts")
    assert len(_files(cache)) == 3


def test_an_unwritable_folder_loads_without_the_cache(layer, src, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KT_PACKED_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    with caplog.at_level(logging.WARNING, "ktransformers.packed_cache"):
        k, how = _kernel(layer, src)
    assert how == "packed" and "cannot be written" in caplog.text
    x, ids, w = _inputs()
    assert np.isfinite(k.forward(x, ids, w)).all()


def test_turned_off(layer, src, tmp_path, monkeypatch):
    monkeypatch.setenv("KT_PACKED_CACHE", "0")
    assert pc.cache_dir() is None
    assert _kernel(layer, src)[1] == "packed"


def test_prepacked_of_the_wrong_size_is_refused(layer):
    g, u, d = layer
    buf = torch.zeros(8192, dtype=torch.uint8)  # torch's allocator aligns to 64 bytes
    with pytest.raises(ValueError, match="different size"):
        K.MoEKernel(K.cpu_infer(1), "AMXInt8", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K, prepacked=buf[:4096])
    with pytest.raises(ValueError, match="64-byte aligned"):
        K.MoEKernel(K.cpu_infer(1), "AMXInt8", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K, prepacked=buf[1:4097])
    with pytest.raises(ValueError, match="llamafile"):
        K.MoEKernel(K.cpu_infer(1), "llamafile", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, QT.Q4_K,
                    prepacked=np.zeros(64, np.uint8))


def test_checksum_is_the_same_for_any_thread_count():
    a = np.random.default_rng(0).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    h1 = K.cpu_infer(1)._c.checksum(a.ctypes.data, a.nbytes)
    h2 = K.cpu_infer(2)._c.checksum(a.ctypes.data, a.nbytes)
    assert h1 == h2
    b = a.copy()
    b[-1] ^= 1
    assert K.cpu_infer(2)._c.checksum(b.ctypes.data, b.nbytes) != h1


# ------------------------------------------------------------------------------------ fuzzing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_a_cache_file_is_caught(layer, tmp_path, data):
    """Random overwrites, truncations and extensions of a valid file, or a random header: the
    reader answers "not valid, because ..." (never an exception, never a wrong copy used)."""
    import json

    src = tmp_path / "m.gguf"
    if not src.exists():
        src.write_bytes(b"GGUF")
    folder = tmp_path / "c"
    before = os.environ.get("KT_PACKED_CACHE")
    os.environ["KT_PACKED_CACHE"] = str(folder)
    try:
        _kernel(layer, src)
        (f,) = _files(folder)
        good = f.read_bytes()
        kind = data.draw(st.sampled_from(["flip", "cut", "grow", "header"]))
        b = bytearray(good)
        if kind == "flip":
            at = data.draw(st.integers(0, len(b) - 1))
            b[at] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            b = b[:data.draw(st.integers(0, len(b) - 1))]
        elif kind == "grow":
            b += data.draw(st.binary(min_size=1, max_size=64))
        elif data.draw(st.booleans()):  # any JSON value at all
            body = json.dumps(data.draw(st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                                     lambda c: st.lists(c, max_size=3), max_leaves=6))).encode()
            b[len(pc.MAGIC):pc.HEADER] = (len(body).to_bytes(4, "little") + body).ljust(pc.HEADER - len(pc.MAGIC), b"\0")
        else:
            meta = data.draw(st.dictionaries(st.sampled_from(["format", "key", "backend", "tier", "source", "shape",
                                                              "types", "packed_bytes", "checksum"]),
                                             st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=9))
            body = json.dumps(meta).encode()
            b[len(pc.MAGIC):pc.HEADER] = (len(body).to_bytes(4, "little") + body).ljust(pc.HEADER - len(pc.MAGIC), b"\0")
        f.write_bytes(bytes(b))
        ident = json.loads(good[len(pc.MAGIC) + 4:len(pc.MAGIC) + 4 + int.from_bytes(good[8:12], "little")])
        ident = {k: v for k, v in ident.items() if k not in ("packed_bytes", "checksum")}
        got, why = pc._read(f, ident, K.cpu_infer(2))
        if bytes(b) == good:
            assert got is not None
        elif kind == "flip" and got is not None:
            # a flip inside the header's padding changes nothing that is read
            assert bytes(b[pc.HEADER:]) == good[pc.HEADER:]
        else:
            assert got is None and why
    finally:
        if before is None:
            os.environ.pop("KT_PACKED_CACHE", None)
        else:
            os.environ["KT_PACKED_CACHE"] = before
        for f in _files(folder):
            f.unlink()
