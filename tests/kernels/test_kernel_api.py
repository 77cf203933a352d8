"""The kernels' library face (docs/kernels.md): what another engine calls without the rule engine or
transformers.

* ``API_VERSION`` is semantic and is the version docs/kernels.md promises; every public name is
  documented there.
* ``MoEKernel.from_gguf`` / ``from_safetensors`` build one layer's experts from a file; the output is
  compared with an independent reference: torch (float64) on the experts as gguf-py dequantizes them
  (GGUF) or as written (safetensors).  Tolerances, ||out - ref|| / ||ref||: exact float weights with
  fp32 activations 1e-4; bf16 weights 1e-2; K-quant weights (int8-quantized activations) 3e-2 (the
  bounds of tests/kernels/test_moe.py).
* ``forward`` and ``submit`` / ``sync`` from plain torch tensors.
* pools pinned to a NUMA node's CPUs: node lists read from a fake sysfs tree, the pool's threads'
  affinity read back from /proc.
* bad input (layers, files, layouts, pools, CPU lists) is one error naming the thing; fuzzed.
* examples/moe_layer_from_torch.py runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import finish
from safetensors.torch import save_file

import ktransformers.kernels as K
from ktransformers.errors import WeightError
from ktransformers.kernels import numa
from ktransformers.kernels import pool as pool_module
from ktransformers.weights.quantize import quantize

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kernels.md"
E, H, I, TOPK = 8, 256, 256, 2
QUANT_TOL, BF16_TOL, F32_TOL = 3e-2, 1e-2, 1e-4


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


# ---------------------------------------------------------------------------------------- helpers
def write_gguf(path: Path, types=("Q4_K", "Q4_K", "Q6_K"), arch: str = "qwen3moe", layers: int = 2, seed: int = 0,
               down_shape=None) -> Path:
    """A GGUF of ``layers`` MoE layers (experts only) as llama.cpp stores them: stacked ``[E, rows, cols]``."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, val in (("block_count", layers), ("expert_count", E), ("expert_used_count", TOPK),
                     ("attention.head_count", 4), ("embedding_length", H)):
        w.add_uint32(f"{arch}.{key}", val)
    for layer in range(layers):
        for proj, shape, qt in (("gate", (E, I, H), types[0]), ("up", (E, I, H), types[1]),
                                ("down", down_shape or (E, H, I), types[2])):
            x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            data = x if qt == "F32" else quantize(x, qt).reshape(*shape[:2], -1)
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=gguf.GGMLQuantizationType[qt])
    return finish(w, path)


def gguf_experts(path: Path, layer: int) -> tuple[torch.Tensor, ...]:
    """(gate, up, down) of ``layer`` as gguf-py reads and dequantizes them (not the project's reader)."""
    ts = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    out = []
    for proj in ("gate", "up", "down"):
        t = ts[f"blk.{layer}.ffn_{proj}_exps.weight"]
        out.append(torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)))
    return tuple(out)


def torch_moe(x, ids, w, gate, up, down) -> torch.Tensor:
    """float64 torch reference: sum_k w[t, k] * down_e(silu(gate_e x) * up_e x); id -1 skips a slot."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        rows, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[rows].double()
        y = (torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)) @ down[e].double().T
        out.index_add_(0, rows, y * w[rows, slot].double()[:, None])
    return out


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def routing(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    w = torch.rand(T, TOPK, generator=g) + 0.1
    return x, ids, w


@pytest.fixture(scope="module")
def q_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf")


# ---------------------------------------------------------------------------------------- version
def test_api_version_is_semantic_and_the_documented_one():
    assert re.fullmatch(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)", K.API_VERSION)
    doc = DOC.read_text()
    m = re.search(r"API version: `(\d+\.\d+\.\d+)`", doc)
    assert m and m.group(1) == K.API_VERSION, "docs/kernels.md states another API version"
    assert "compatib" in doc.lower()


def test_every_public_name_is_documented():
    doc = DOC.read_text()
    missing = [n for n in K.__all__ if f"`{n}" not in doc]
    assert not missing, f"docs/kernels.md does not document {missing}"
    for n in K.__all__:
        assert hasattr(K, n), n


def test_readme_links_the_kernel_docs():
    assert "docs/kernels.md" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------- from_gguf
@pytest.mark.parametrize("layer", [0, 1])
def test_from_gguf_matches_torch_on_gguf_py_dequantized_weights(q_gguf, pool, layer):
    moe = K.MoEKernel.from_gguf(q_gguf, layer, pool=pool)
    assert (moe.num_experts, moe.hidden, moe.intermediate, moe.types) == (E, H, I, ("Q4_K", "Q4_K", "Q6_K"))
    x, ids, w = routing(9, seed=layer)
    ref = torch_moe(x, ids, w, *gguf_experts(q_gguf, layer))
    assert rel_err(moe.forward(x, ids, w), ref) < QUANT_TOL


def test_from_gguf_reads_the_experts_in_place(q_gguf, pool):
    """llamafile: the kernel's weights are views of the file mapping, not copies."""
    moe = K.MoEKernel.from_gguf(q_gguf, 0, pool=pool)
    for a in moe._weights[:3]:
        base = a
        while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap), type(base)


def test_from_gguf_f32_experts_exact(tmp_path, pool):
    path = write_gguf(tmp_path / "f32.gguf", types=("F32", "F32", "F32"), layers=1)
    moe = K.MoEKernel.from_gguf(path, 0, pool=pool)
    x, ids, w = routing(5)
    assert rel_err(moe.forward(x, ids, w), torch_moe(x, ids, w, *gguf_experts(path, 0))) < F32_TOL


def test_from_gguf_of_an_architecture_without_a_name_table(tmp_path, pool):
    """Read by the GGUF tensor names themselves."""
    path = write_gguf(tmp_path / "other.gguf", arch="someengine", layers=1, types=("Q8_0", "Q8_0", "Q8_0"))
    moe = K.MoEKernel.from_gguf(path, 0, pool=pool)
    x, ids, w = routing(4)
    assert rel_err(moe.forward(x, ids, w), torch_moe(x, ids, w, *gguf_experts(path, 0))) < QUANT_TOL


def test_from_gguf_packed_backend_and_prepacked_copy(q_gguf, pool):
    """A packed backend from the file; its packed copy builds a second kernel (``prepacked``)."""
    moe = K.MoEKernel.from_gguf(q_gguf, 1, backend="AMXInt8", pool=pool)
    x, ids, w = routing(6)
    y = moe.forward(x, ids, w)
    assert rel_err(y, torch_moe(x, ids, w, *gguf_experts(q_gguf, 1))) < 4e-2
    raw = [K.MoEKernel.from_gguf(q_gguf, 1, pool=pool)._weights[i] for i in range(3)]
    again = K.MoEKernel(pool, "AMXInt8", E, H, I, *raw, "Q4_K", "Q4_K", "Q6_K", prepacked=moe.packed_view())
    assert torch.equal(again.forward(x, ids, w), y)


# ---------------------------------------------------------------------------------------- safetensors
def expert_tensors(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) * 0.05, torch.randn(E, I, H, generator=g) * 0.05,
            torch.randn(E, H, I, generator=g) * 0.05)


def test_from_safetensors_per_expert_bf16(tmp_path, pool):
    gate, up, down = (t.bfloat16() for t in expert_tensors())
    tensors = {}
    for e in range(E):
        for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = t[e].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    moe = K.MoEKernel.from_safetensors(tmp_path, 0, pool=pool)
    assert moe.types == ("BF16", "BF16", "BF16")
    x, ids, w = routing(7)
    assert rel_err(moe.forward(x, ids, w), torch_moe(x, ids, w, gate.float(), up.float(), down.float())) < BF16_TOL


@pytest.mark.parametrize("layout", ["fused", "mixtral"])
def test_from_safetensors_fused_and_mixtral_names(tmp_path, pool, layout):
    gate, up, down = expert_tensors()
    if layout == "fused":  # transformers 5: experts.gate_up_proj [E, 2I, H], experts.down_proj
        tensors = {"model.layers.1.mlp.experts.gate_up_proj": torch.cat([gate, up], 1).contiguous(),
                   "model.layers.1.mlp.experts.down_proj": down.contiguous()}
    else:
        tensors = {}
        for e in range(E):
            for name, t in (("w1", gate), ("w3", up), ("w2", down)):
                tensors[f"model.layers.1.block_sparse_moe.experts.{e}.{name}.weight"] = t[e].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    moe = K.MoEKernel.from_safetensors(tmp_path / "model.safetensors", 1, pool=pool)
    assert moe.types == ("F32", "F32", "F32")
    x, ids, w = routing(5)
    assert rel_err(moe.forward(x, ids, w), torch_moe(x, ids, w, gate, up, down)) < F32_TOL


def test_from_safetensors_loads_the_experts_biases(tmp_path, pool):
    gate, up, down = expert_tensors()
    g = torch.Generator().manual_seed(5)
    gb, ub = torch.randn(E, I, generator=g) * 0.1, torch.randn(E, I, generator=g) * 0.1
    db = torch.randn(E, H, generator=g) * 0.1
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.cat([gate, up], 1).contiguous(),
               "model.layers.0.mlp.experts.down_proj": down.contiguous(),
               "model.layers.0.mlp.experts.gate_proj_bias": gb, "model.layers.0.mlp.experts.up_proj_bias": ub,
               "model.layers.0.mlp.experts.down_proj_bias": db}, str(tmp_path / "m.safetensors"))
    moe = K.MoEKernel.from_safetensors(tmp_path / "m.safetensors", 0, pool=pool)
    x, ids, w = routing(6)
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(TOPK):
            e, xt = int(ids[t, j]), x[t].double()
            h = torch.nn.functional.silu(gate[e].double() @ xt + gb[e]) * (up[e].double() @ xt + ub[e])
            ref[t] += float(w[t, j]) * (down[e].double() @ h + db[e])
    assert rel_err(moe.forward(x, ids, w), ref) < F32_TOL


# ---------------------------------------------------------------------------------------- plain torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_submit_sync_from_plain_torch(q_gguf, pool, dtype):
    moe = K.MoEKernel.from_gguf(q_gguf, 0, pool=pool)
    x, ids, w = routing(11)
    ids[3, 1] = -1  # a skipped slot
    ids32 = ids.to(torch.int32)  # converted by the wrapper
    y = moe.forward(x.to(dtype), ids32, w)
    assert y.dtype == dtype and y.shape == (11, H)
    out = torch.empty(11, H, dtype=dtype)
    moe.submit(x.to(dtype), ids, w, out)
    pool.sync()
    assert torch.equal(out, y)
    tol = QUANT_TOL if dtype == torch.float32 else QUANT_TOL + BF16_TOL
    assert rel_err(y.float(), torch_moe(x.to(dtype).float(), ids, w, *gguf_experts(q_gguf, 0))) < tol


def test_submits_of_two_layers_then_one_sync(q_gguf, pool):
    layers = [K.MoEKernel.from_gguf(q_gguf, n, pool=pool) for n in (0, 1)]
    x, ids, w = routing(4)
    outs = [torch.full((4, H), float("nan")) for _ in layers]
    for m, o in zip(layers, outs):
        m.submit(x, ids, w, o)
    pool.sync()
    for m, o in zip(layers, outs):
        assert torch.equal(o, m.forward(x, ids, w))


# ---------------------------------------------------------------------------------------- bad input
def test_missing_layer_names_the_layers_that_have_experts(q_gguf):
    with pytest.raises(WeightError, match=r"layer 7 has no routed experts .*blk\.7\.ffn_gate_exps\.weight.*"
                                          r"layers with experts: 0, 1"):
        K.MoEKernel.from_gguf(q_gguf, 7)


@pytest.mark.parametrize("layer", [-1, "0", 1.0, True, None])
def test_layer_must_be_a_non_negative_int(q_gguf, layer):
    with pytest.raises(ValueError, match="layer: expected a non-negative int"):
        K.MoEKernel.from_gguf(q_gguf, layer)


def test_file_of_the_other_kind_is_named(q_gguf, tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="holds safetensors weights; use MoEKernel.from_safetensors"):
        K.MoEKernel.from_gguf(tmp_path, 0)
    with pytest.raises(WeightError, match="holds GGUF weights; use MoEKernel.from_gguf"):
        K.MoEKernel.from_safetensors(q_gguf, 0)
    with pytest.raises(WeightError, match="no such file"):
        K.MoEKernel.from_gguf(tmp_path / "absent.gguf", 0)


def test_caller_arguments_are_checked_before_the_file(tmp_path):
    absent = tmp_path / "absent.gguf"
    with pytest.raises(ValueError, match="backend: expected one of"):
        K.MoEKernel.from_gguf(absent, 0, backend="llamafle")
    with pytest.raises(ValueError, match="activation: expected one of"):
        K.MoEKernel.from_gguf(absent, 0, activation="relu")
    with pytest.raises(TypeError, match="pool: expected ktransformers.kernels.CPUInfer"):
        K.MoEKernel.from_gguf(absent, 0, pool=4)


def test_experts_of_disagreeing_shapes_are_named(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", types=("F32", "F32", "F32"), layers=1, down_shape=(E, H, I // 2))
    with pytest.raises(WeightError, match=r"layer 0: expected gate/up \[E, I, H\] and down \[E, H, I\].*"
                                          r"model\.layers\.0\.mlp\.experts\.down_proj \[8, 256, 128\]"):
        K.MoEKernel.from_gguf(path, 0)


def test_a_bias_the_kernel_refuses_names_the_file_and_layer(tmp_path):
    gate, up, down = expert_tensors()
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.cat([gate, up], 1).contiguous(),
               "model.layers.0.mlp.experts.down_proj": down.contiguous(),
               "model.layers.0.mlp.experts.gate_proj_bias": torch.zeros(E, I + 1)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(WeightError, match=r"m\.safetensors: layer 0: the llamafile CPU kernel cannot take these "
                                          r"experts: gate_bias: expected float32 \[8, 256\]"):
        K.MoEKernel.from_safetensors(tmp_path / "m.safetensors", 0)


# ---------------------------------------------------------------------------------------- NUMA
def fake_sysfs(root: Path, nodes: dict[str, str]) -> Path:
    """``root/nodeN/cpulist`` for each entry, plus the files sysfs keeps beside them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "online").write_text(",".join(n[4:] for n in nodes) + "\n")
    (root / "possible").write_text("0-3\n")
    (root / "power").mkdir()
    for name, cpus in nodes.items():
        (root / name).mkdir()
        (root / name / "cpulist").write_text(cpus + "\n")
        (root / name / "meminfo").write_text(f"Node {name[4:]} MemTotal: 1024 kB\n")
    return root


def test_numa_nodes_from_a_two_socket_tree(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node0": "0-3,8-11", "node1": "4-7,12-15", "node2": ""})
    assert K.numa_nodes(root) == {0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15), 2: ()}
    assert K.numa_nodes(tmp_path / "absent") == {}


def test_node_cpus_keeps_the_cpus_this_process_may_use(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path / "node", {"node0": f"{allowed[0]},4000-4003", "node1": "", "node3": "9999"})
    assert K.node_cpus(0, root) == (allowed[0],)
    with pytest.raises(ValueError, match=r"numa_node: node 1 has no CPU this process may run on \(node CPUs: none"):
        K.node_cpus(1, root)
    with pytest.raises(ValueError, match=r"numa_node: node 2 does not exist \(nodes: 0, 1, 3\)"):
        K.node_cpus(2, root)
    with pytest.raises(ValueError, match="numa_node: expected a non-negative int"):
        K.node_cpus(-1, root)


def test_a_corrupt_cpulist_names_the_file(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node0": "0-3", "node1": "4-x"})
    with pytest.raises(ValueError, match=r"node1/cpulist: '4-x' is not a CPU number or range"):
        K.numa_nodes(root)


def _task_affinities() -> dict[int, tuple[int, ...]]:
    """tid -> CPUs allowed, for every thread of this process (read from /proc)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        m = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
        out[int(tid)] = numa.parse_cpulist(m.group(1))
    return out


def _pinned_pool_threads(make) -> tuple[object, list[tuple[int, ...]]]:
    before = _task_affinities()
    mine = os.sched_getaffinity(0)
    p = make()
    assert os.sched_getaffinity(0) == mine, "the creating thread's mask is restored"
    new = [cpus for tid, cpus in _task_affinities().items() if tid not in before]
    return p, new


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning is seen with 2+ usable CPUs")


@needs_two_cpus
def test_pool_pinned_to_a_numa_node(tmp_path, monkeypatch):
    """The pool's worker and queue threads run on the node's CPUs only."""
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path / "node", {"node0": str(allowed[0]), "node1": format(allowed[-1])})
    monkeypatch.setattr(numa, "NODE_ROOT", root)
    monkeypatch.setattr(pool_module, "_pools", {})  # the shared pools made here go with the fake tree
    p, new = _pinned_pool_threads(lambda: K.CPUInfer(2, numa_node=1))
    assert p.cpus == (allowed[-1],) and p.numa_node == 1 and p.threads == 2
    assert len(new) == 2 and all(cpus == (allowed[-1],) for cpus in new), new  # one worker + the queue thread
    moe_pool = K.cpu_infer(numa_node=0)
    assert moe_pool.cpus == (allowed[0],) and moe_pool.threads == 1 and K.cpu_infer(numa_node=0) is moe_pool


@needs_two_cpus
def test_pinned_pool_computes_like_an_unpinned_one(q_gguf, pool):
    allowed = sorted(os.sched_getaffinity(0))
    p, new = _pinned_pool_threads(lambda: K.CPUInfer(cpus=[allowed[0]]))
    assert p.threads == 1 and new == [(allowed[0],)]  # the queue thread
    x, ids, w = routing(5)
    y = K.MoEKernel.from_gguf(q_gguf, 0, pool=p).forward(x, ids, w)
    assert rel_err(y, torch_moe(x, ids, w, *gguf_experts(q_gguf, 0))) < QUANT_TOL


def test_pool_cpu_arguments_are_checked():
    with pytest.raises(ValueError, match="numa_node, cpus: give one of them"):
        K.CPUInfer(numa_node=0, cpus=[0])
    with pytest.raises(ValueError, match=r"cpus: 100000: not CPUs this process may run on"):
        K.CPUInfer(cpus=[100000])
    with pytest.raises(ValueError, match="cpus: empty"):
        K.CPUInfer(cpus=[])
    with pytest.raises(ValueError, match="cpus: expected CPU numbers"):
        K.CPUInfer(cpus=[0.5])


# ---------------------------------------------------------------------------------------- fuzz
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(st.sets(st.integers(0, 4095), max_size=64))
def test_fuzz_cpulist_round_trip(cpus):
    text = numa.format_cpulist(cpus)
    assert numa.parse_cpulist(text) == tuple(sorted(cpus))


@FUZZ
@given(st.text(alphabet="0123456789-,: x\n\t٣", max_size=24) | st.text(max_size=12))
def test_fuzz_cpulist_text_is_parsed_or_named(text):
    try:
        cpus = numa.parse_cpulist(text, "node0/cpulist")
    except ValueError as e:
        assert str(e).startswith("node0/cpulist: ") and "\n" not in str(e)
        return
    assert all(isinstance(c, int) and 0 <= c < numa.MAX_CPUS for c in cpus) and list(cpus) == sorted(set(cpus))


@FUZZ
@given(st.one_of(st.integers(-3, 10 ** 12), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans()))
def test_fuzz_layer_values(q_gguf, layer):
    try:
        K.MoEKernel.from_gguf(q_gguf, layer, pool=K.cpu_infer(2))
    except ValueError as e:
        assert str(e).startswith("layer: expected a non-negative int")
    except WeightError as e:
        assert f"layer {layer} has no routed experts" in str(e)
    else:
        assert layer in (0, 1) and not isinstance(layer, bool)


@FUZZ
@given(st.lists(st.one_of(st.integers(-2, 1 << 20), st.floats(), st.text(max_size=2)), max_size=4)
       | st.text(max_size=4))
def test_fuzz_pool_cpus(cpus):
    allowed = os.sched_getaffinity(0)
    try:
        p = K.CPUInfer(cpus=cpus)
    except ValueError as e:
        assert str(e).startswith("cpus: ") and "\n" not in str(e)
        return
    assert set(p.cpus) <= allowed and p.threads == len(p.cpus)


# ---------------------------------------------------------------------------------------- example
def test_example_runs_a_moe_layer_from_plain_torch():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "moe_layer_from_torch.py"), "--tokens", "6",
                        "--threads", "2"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout.splitlines()[-1]
    assert f"API {K.API_VERSION}" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--gguf", "/nonexistent/moe.gguf"], "error: /nonexistent/moe.gguf: no such file or directory"),
    (["--layer", "3"], "error: .*moe-layer.gguf: layer 3 has no routed experts"),
    (["--numa-node", "9999"], "error: numa_node: node 9999 does not exist"),
])
def test_example_refuses_bad_input_in_one_line(args, message):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "moe_layer_from_torch.py"), "--tokens", "2", *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.fullmatch(message + r".*", r.stderr.strip()) and "Traceback" not in r.stderr, r.stderr
