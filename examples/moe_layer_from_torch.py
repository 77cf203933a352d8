"""One MoE layer from plain torch: the router in torch, the routed experts on the CPU kernels.

What another engine does with ``ktransformers.kernels`` (docs/kernels.md): no rule file, no
transformers model.  The experts of one layer are built straight from a GGUF file
(``MoEKernel.from_gguf``), the router runs in torch, the experts run on the kernel (blocking
``forward``, then asynchronously with ``submit`` / ``sync`` while torch works), and the output is
compared with a torch reference on the same experts dequantized by gguf-py.

    python examples/moe_layer_from_torch.py                       # writes a small Q4_K/Q6_K layer first
    python examples/moe_layer_from_torch.py --gguf model.gguf --layer 3 --numa-node 0

Exit code 0 when the kernel matches the reference within ``--tolerance`` (relative Frobenius error;
0.03 covers the kernel's int8-quantized activations on K-quant weights), 1 otherwise, 2 with one
``error:`` line for a file, layer or NUMA node that cannot be used.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

import ktransformers.kernels as K
from ktransformers.weights.quantize import quantize


def write_layer(path: Path, experts: int = 8, hidden: int = 256, intermediate: int = 512, seed: int = 0) -> None:
    """A one-layer qwen3moe GGUF holding a router and Q4_K gate/up, Q6_K down experts."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    for key, val in (("block_count", 1), ("expert_count", experts), ("expert_used_count", 2),
                     ("attention.head_count", 4), ("embedding_length", hidden)):
        w.add_uint32(f"qwen3moe.{key}", val)
    w.add_tensor("blk.0.ffn_gate_inp.weight", (rng.standard_normal((experts, hidden)) * 0.1).astype(np.float32))
    for proj, rows, cols, qt in (("gate", intermediate, hidden, "Q4_K"), ("up", intermediate, hidden, "Q4_K"),
                                 ("down", hidden, intermediate, "Q6_K")):
        x = (rng.standard_normal((experts, rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", quantize(x, qt).reshape(experts, rows, -1),
                     raw_dtype=gguf.GGMLQuantizationType[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class Reference:
    """The layer's tensors as gguf-py reads and dequantizes them (independent of the kernels)."""

    def __init__(self, path: Path, layer: int):
        self.tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        self.layer = layer

    def _deq(self, name: str, expert: int | None = None) -> torch.Tensor:
        t = self.tensors[name]
        data = t.data if expert is None else t.data[expert]
        return torch.from_numpy(np.array(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32))

    def router(self) -> torch.Tensor | None:
        name = f"blk.{self.layer}.ffn_gate_inp.weight"
        return self._deq(name) if name in self.tensors else None

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * down(silu(gate x) * up x) of expert ids[t, k], in float64."""
        out = torch.zeros(x.shape, dtype=torch.float64)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            g, u, d = (self._deq(f"blk.{self.layer}.ffn_{p}_exps.weight", e).double() for p in ("gate", "up", "down"))
            xe = x[rows].double()
            y = (torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)) @ d.T
            out.index_add_(0, rows, y * weights[rows, slot].double()[:, None])
        return out


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, renormalized (Qwen3-MoE / Mixtral): (ids [T, k] int64, weights [T, k] f32)."""
    probs = torch.softmax(x @ router.T, dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a MoE GGUF (default: write a small one to a temporary folder)")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="kernel pool threads (default: all, or the node's)")
    ap.add_argument("--numa-node", type=int, default=None, help="pin the kernel pool to this NUMA node's CPUs")
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.gguf
        if path is None:
            path = Path(tmp) / "moe-layer.gguf"
            write_layer(path)
        print(f"ktransformers.kernels API {K.API_VERSION}, ISA tier {K.isa_tier()}")
        pool = K.cpu_infer(args.threads, numa_node=args.numa_node)
        moe = K.MoEKernel.from_gguf(path, args.layer, backend="llamafile", pool=pool)
        print(f"layer {args.layer}: {moe.num_experts} experts, hidden {moe.hidden}, intermediate {moe.intermediate}, "
              f"types {'/'.join(moe.types)}; pool of {pool.threads} threads"
              + (f" on CPUs {pool.cpus}" if pool.cpus else ""))

        ref = Reference(path, args.layer)
        torch.manual_seed(0)
        x = torch.randn(args.tokens, moe.hidden)
        router = ref.router()
        if router is None:  # a file without the router: a random one, for the demonstration
            router = torch.randn(moe.num_experts, moe.hidden) * 0.1
        ids, weights = route(x, router, args.top_k)

        y = moe.forward(x, ids, weights)  # blocking

        y_async = torch.empty_like(x)
        moe.submit(x, ids, weights, y_async)  # returns at once: the engine computes meanwhile
        expected = ref.experts(x, ids, weights)
        pool.sync()  # y_async is complete from here on

        err, err_async = rel_err(y, expected), rel_err(y_async, expected)
        print(f"relative error vs torch on the dequantized weights: forward {err:.2e}, submit/sync "
              f"{err_async:.2e} (tolerance {args.tolerance})")
        ok = err <= args.tolerance and err_async <= args.tolerance and torch.equal(y, y_async)
        print("OK" if ok else "MISMATCH")
        return 0 if ok else 1


if __name__ == "__main__":
    from ktransformers.errors import KTError

    try:
        sys.exit(main())
    except (KTError, ValueError, TypeError) as e:  # a bad file, layer, node: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
