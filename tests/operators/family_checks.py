"""What the family tests (gpt-oss, Qwen3-Next, DeepSeek-V3.2 / GLM-5) share: the expert-backend swaps of a
shipped ``-cpu`` rule file, prompt ids, and the error measure their tolerances are stated in."""

from __future__ import annotations

import torch

#: the routed-experts op of the shipped -cpu rule files
EXPERTS_CPU = "generate_op: KExpertsCPU\n      backend: llamafile"
#: backend -> (rule text to replace, its replacement, tolerance relative to max |logit|)
BACKEND_SWAPS = {
    "KExpertsTorch": (EXPERTS_CPU, "generate_op: KExpertsTorch", 1e-4),
    "AMXBF16": ("backend: llamafile", "backend: AMXBF16", 1e-2),
    "AMXInt8": ("backend: llamafile", "backend: AMXInt8", 3e-2),
}


def prompt_ids(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| relative to max |ref|."""
    return (got - ref).abs().max().item() / ref.abs().max().item()
