"""How a transformers 5 experts module lays out its parameters, and the conversions to and from the
stacked layout the weight sources serve (``source.py``: gate / up ``[E, I, H]``, down ``[E, H, I]``).

The flags are the ones transformers' ``use_experts_implementation`` sets on the module
(``is_transposed``, ``is_concatenated``, ``has_bias``); gpt-oss is the family that sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module lays out its parameters (from transformers' ``use_experts_implementation``
    flags on the module).

    Default (every family but gpt-oss): ``gate_up_proj [E, 2I, H] = cat(gate, up)``, ``down_proj
    [E, H, I]`` -- the stacked layout itself.  gpt-oss: ``transposed`` (``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``), ``interleaved`` gate/up along 2I (gate 0, up 0, gate 1, ...) and
    ``bias`` (``gate_up_proj_bias [E, 2I]``, interleaved alike, ``down_proj_bias [E, H]``).
    """

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False

    @classmethod
    def of(cls, module) -> "ExpertsLayout":
        return cls(bool(getattr(module, "is_transposed", False)), not getattr(module, "is_concatenated", True),
                   bool(getattr(module, "has_bias", False)))

    @property
    def stacked(self) -> bool:
        """The parameters are already in the stacked layout."""
        return not (self.transposed or self.interleaved)

    def describe(self) -> str:
        parts = [p for p, on in (("transposed", self.transposed), ("gate/up interleaved", self.interleaved),
                                 ("per-expert biases", self.bias)) if on]
        return ", ".join(parts) or "stacked"

    def stacked_shapes(self, leaf: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The stacked names (below the experts module) and shapes a source serves for the module's
        parameter ``leaf`` of ``shape`` (GGUF files, per-expert checkpoints)."""
        shape = tuple(shape)
        if leaf == "gate_up_proj" and not self.stacked:
            E, a, b = shape
            H, two_i = (a, b) if self.transposed else (b, a)
            return {"gate_proj": (E, two_i // 2, H), "up_proj": (E, two_i // 2, H)}
        if leaf == "down_proj" and self.transposed:
            return {"down_proj": (shape[0], shape[2], shape[1])}
        if leaf == "gate_up_proj_bias":
            return {"gate_proj_bias": (shape[0], shape[1] // 2), "up_proj_bias": (shape[0], shape[1] // 2)}
        return {leaf: shape}

    # parameter layout -> stacked layout
    def gate_up(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up), each ``[E, I, H]``, from the module's ``gate_up_proj``."""
        if self.transposed:
            gate_up = gate_up.transpose(1, 2)
        if self.interleaved:
            return gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous()
        g, u = gate_up.chunk(2, dim=1)
        return g.contiguous(), u.contiguous()

    def down(self, down: torch.Tensor) -> torch.Tensor:
        """``[E, H, I]`` from the module's ``down_proj``."""
        return down.transpose(1, 2).contiguous() if self.transposed else down.contiguous()

    def gate_up_bias(self, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate bias, up bias), each ``[E, I]``, from the module's ``gate_up_proj_bias``."""
        if self.interleaved:
            return bias[:, 0::2].contiguous(), bias[:, 1::2].contiguous()
        g, u = bias.chunk(2, dim=-1)
        return g.contiguous(), u.contiguous()

    # stacked layout -> parameter layout (writing checkpoints, building references)
    def gate_up_param(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            gu = torch.stack((gate, up), dim=2).reshape(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        else:
            gu = torch.cat((gate, up), dim=1)
        return gu.transpose(1, 2).contiguous() if self.transposed else gu

    def down_param(self, down: torch.Tensor) -> torch.Tensor:
        return down.transpose(1, 2).contiguous() if self.transposed else down

    def gate_up_bias_param(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return torch.stack((gate, up), dim=2).reshape(gate.shape[0], 2 * gate.shape[1])
        return torch.cat((gate, up), dim=-1)
