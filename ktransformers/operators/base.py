"""Base class for injected modules, and the per-phase op machinery they share.

An injected module replaces one module of the unmodified transformers model.  It

* keeps the original module (unregistered, so parameter names do not change) and falls back
  to it for plain attributes (``in_features``, ``layer_idx``, ``config`` ...);
* adopts the original's child modules under the same names, so rules below it still match
  and checkpoints still address them by their usual names;
* owns up to two *ops* — the computation for the prefill phase and for the generate
  (decode) phase — each living on its own device.  ``forward`` picks the op by the number of
  tokens in the call: more than ``prefill_threshold`` tokens runs the prefill op.

Constructor contract (kept from the reference system so existing rules and third-party
operators fit): ``cls(key, gguf_loader, config, orig_module, **kwargs)`` where ``key`` is the
module's dotted name and ``gguf_loader`` the weight source.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..errors import RuleError
from .op import KwargSpec, Op
from .phases import PhaseError, Phases, decide_phases

DEFAULT_PREFILL_THRESHOLD = 64
PHASES = ("prefill", "generate")


class BaseInjectedModule(nn.Module):
    """Common base of every operator a rule can inject (see the module docstring)."""

    #: op table of this operator family: name -> Op subclass (None: the family has no ops)
    OPS: ClassVar[dict[str, type[Op]] | None] = None
    #: the family's name in the compatibility table of reference op names
    OP_TABLE_NAME: ClassVar[str | None] = None
    DEFAULT_OP: ClassVar[str | None] = None
    #: module kinds (``kinds.py``) this operator can replace; empty: any (third-party operators)
    REPLACES: ClassVar[tuple[str, ...]] = ()
    #: rule kwargs accepted by the wrapper itself (devices/ops are common to all)
    KWARGS: ClassVar[dict[str, KwargSpec]] = {}
    COMMON_KWARGS: ClassVar[dict[str, KwargSpec]] = {
        "generate_device": KwargSpec((str,), None, "device of the decode phase"),
        "prefill_device": KwargSpec((str,), None, "device of the prefill phase"),
        "generate_op": KwargSpec((str,), None, "op of the decode phase"),
        "prefill_op": KwargSpec((str, type(None)), None, "op of the prefill phase (null: use the generate op)"),
        "out_device": KwargSpec((str,), None, "where outputs go (default: where inputs came from)"),
        "prefill_threshold": KwargSpec((int,), DEFAULT_PREFILL_THRESHOLD,
                                       "calls with more tokens than this run the prefill op"),
    }

    @classmethod
    def can_replace(cls, module: nn.Module) -> bool:
        from .kinds import kinds_of

        return not cls.REPLACES or bool(set(cls.REPLACES) & kinds_of(module))

    def __init__(
        self,
        key: str,
        gguf_loader=None,
        config=None,
        orig_module: nn.Module | None = None,
        prefill_device: str | torch.device | None = None,
        generate_device: str | torch.device | None = None,
        phases: Phases | None = None,
        formats: dict[str, dict] | None = None,
        **kwargs,
    ):
        super().__init__()
        object.__setattr__(self, "orig_module", orig_module)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "gguf_loader", gguf_loader)
        object.__setattr__(self, "config", config)
        if phases is None:  # built outside a plan: decide here, the same way the plan does
            gen = torch.device(generate_device or prefill_device or "cpu")
            try:
                phases = decide_phases(type(self), {**kwargs, "generate_device": str(gen),
                                                    "prefill_device": str(prefill_device or gen)})
            except PhaseError as e:
                raise RuleError(f"{key}: {e}") from None
        object.__setattr__(self, "phases", phases)
        object.__setattr__(self, "generate_device", phases.generate_device)
        object.__setattr__(self, "prefill_device", phases.prefill_device)
        out = kwargs.pop("out_device", None)
        object.__setattr__(self, "out_device", torch.device(out) if out else None)
        thr = kwargs.pop("prefill_threshold", None)
        object.__setattr__(self, "prefill_threshold", DEFAULT_PREFILL_THRESHOLD if thr is None else int(thr))
        object.__setattr__(self, "last_phase", None)
        if orig_module is not None:
            # direct dict writes: nn.Module's add_module/register_* refuse names that
            # __getattr__ can already see through the fallback to the original module
            for name, child in orig_module.named_children():
                self._modules[name] = child
            if self.OPS is None:
                # no ops: the module's own tensors stay registered under their usual names
                # and are loaded by the engine like those of any plain module
                for name, p in orig_module.named_parameters(recurse=False):
                    self._parameters[name] = p
                for name, b in orig_module.named_buffers(recurse=False):
                    self._buffers[name] = b
                    if name in orig_module._non_persistent_buffers_set:
                        self._non_persistent_buffers_set.add(name)
        kwargs.pop("generate_op", None)
        kwargs.pop("prefill_op", None)
        object.__setattr__(self, "op_kwargs", dict(kwargs))
        self._build_ops(kwargs, formats or {})

    # -- ops --------------------------------------------------------------------------
    def _build_ops(self, kwargs: dict, formats: dict[str, dict]) -> None:
        """The ops of the plan's phases, each given the plan's weight formats of its phase
        (``Placement.formats``; empty when built outside a plan: the op decides at load)."""
        ph = self.phases
        if not ph.has_ops:
            object.__setattr__(self, "generate_op", None)
            object.__setattr__(self, "prefill_op", None)
            return
        gen = self._make_op(ph.generate_op, ph.generate_device, kwargs)
        if ph.prefill_disabled:
            pre = None  # the generate op serves every call
        elif ph.shared:
            pre = gen  # same computation, same place: one copy of the weights
        else:
            pre = self._make_op(ph.prefill_op, ph.prefill_device, kwargs)
        gen.formats = dict(formats.get("generate", {}))
        if pre is not None and pre is not gen:
            pre.formats = dict(formats.get("prefill", {}))
        object.__setattr__(self, "generate_op", gen)
        object.__setattr__(self, "prefill_op", pre)

    def _make_op(self, cls: type[Op], device: torch.device, kwargs: dict) -> Op:
        own = {k: v for k, v in kwargs.items() if k in cls.extra_kwargs}
        try:
            return cls(self.key, self.config, self.orig_module, device, **own)
        except PhaseError as e:
            raise RuleError(f"{self.key}: {e}") from None

    @classmethod
    def accepted_kwargs(cls) -> dict[str, KwargSpec]:
        """Every kwarg a rule may pass to this operator (used to validate rule files)."""
        out = dict(cls.COMMON_KWARGS) if cls.OPS is not None else {
            k: v for k, v in cls.COMMON_KWARGS.items() if k in ("generate_device", "prefill_device", "out_device")
        }
        out.update(cls.KWARGS)
        for op in (cls.OPS or {}).values():
            out.update(op.extra_kwargs)
        return out

    def ops(self) -> list[Op]:
        seen, out = set(), []
        for op in (self.generate_op, self.prefill_op):
            if op is not None and id(op) not in seen:
                seen.add(id(op))
                out.append(op)
        return out

    def select_op(self, num_tokens: int) -> Op:
        """The op for a call over ``num_tokens`` tokens (records the phase it chose)."""
        use_prefill = self.prefill_op is not None and num_tokens > self.prefill_threshold
        object.__setattr__(self, "last_phase", "prefill" if use_prefill else "generate")
        return self.prefill_op if use_prefill else self.generate_op

    # -- weights ----------------------------------------------------------------------
    def load(self, weights, dtype: torch.dtype) -> None:
        """Load this module's own tensors (children are loaded by the engine's walk)."""
        for op in self.ops():
            op.load(weights, dtype)
            op.loaded = True

    def unload(self) -> None:
        for op in self.ops():
            op.unload()

    def op_nbytes(self) -> dict[str, int]:
        """Bytes held by this module's ops, per device."""
        out: dict[str, int] = {}
        for op in self.ops():
            out[str(op.device)] = out.get(str(op.device), 0) + op.nbytes()
        return out

    # -- attribute fallback to the original module ------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            orig = self.__dict__.get("orig_module")
            if orig is not None and name not in ("_parameters", "_buffers", "_modules"):
                return getattr(orig, name)
            raise

    def forward(self, *args, **kwargs):
        """Default: the original class's forward, run on this module (sees adopted children)."""
        return type(self.orig_module).forward(self, *args, **kwargs)

    def extra_repr(self) -> str:
        parts = [f"key={self.key}"]
        if self.generate_op is not None:
            parts.append(f"generate={self.generate_op.name}@{self.generate_device}")
            if self.prefill_op is not None and self.prefill_op is not self.generate_op:
                parts.append(f"prefill={self.prefill_op.name}@{self.prefill_device}")
        else:
            parts.append(f"device={self.generate_device}")
        return ", ".join(parts)


def move_to(obj, device: torch.device):
    """Move every tensor inside (nested tuples/lists/dicts of) ``obj`` to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=False)
    if isinstance(obj, tuple):
        return tuple(move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


