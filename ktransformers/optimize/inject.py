"""Apply a plan to a model built on the meta device, then stream its weights in.

Memory: the model's parameters are never materialised as a whole.  Each tensor is read from
the weight source straight onto the device its rule chose (quantized ops keep raw views).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import KTError, RuleError, WeightError
from ..operators.base import BaseInjectedModule, move_to
from ..operators.cpu_attention import use_cpu_attention, use_prompt_rope
from ..operators.cpu_mlp import use_fused_mlp
from ..operators.cpu_linear_attention import use_cpu_linear_attention
from ..operators.cpu_norm import use_fast_norms
from ..operators.cpu_threads import install_prefill_threads
from ..util.peft_adapter import apply_adapter
from ..weights import WeightSource, open_weights
from ..weights.experts_layout import ExpertsLayout
from .plan import Plan, check_devices_available, module_dtype, plan_model

log = logging.getLogger("ktransformers")


def build_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The unmodified transformers causal-LM for ``config``, parameters on the meta device.

    Buffers computed at construction (rotary frequencies, embedding scales) stay real: they
    are small and cannot be read from a checkpoint.
    """
    from accelerate import init_empty_weights

    from ..optimize_rules import auto_model_class

    if dtype is None:
        dtype = _config_dtype(config)
    with init_empty_weights(include_buffers=False):
        model = auto_model_class(config).from_config(config, dtype=dtype)
    model.eval()
    return model


def _config_dtype(config) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def tied_weight_aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameter -> the parameter it shares (``lm_head.weight`` -> ``model.embed_tokens.weight``)
    where the config ties them."""
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(text_cfg, "tie_word_embeddings", False):
        return {}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        return dict(tied)
    return {k: "model.embed_tokens.weight" for k in tied}  # older list form


class ModelWeights:
    """A weight source seen through one model: resolves tied weights (lm_head ↔ embeddings)."""

    def __init__(self, source: WeightSource, model: nn.Module):
        self.source = source
        self.model = model
        self.path = source.path
        self.aliases: dict[str, str] = tied_weight_aliases(model)

    def _name(self, name: str) -> str:
        if not self.source.has(name) and name in self.aliases:
            return self.aliases[name]
        return name

    def has(self, name):
        return self.source.has(self._name(name))

    def shape(self, name):
        return self.source.shape(self._name(name))

    def tensor(self, name, dtype=None, device=None):
        resolved = self._name(name)
        if resolved != name:  # a tied weight: reuse the copy already loaded, when it fits
            try:
                loaded = self.model.get_parameter(resolved)
            except AttributeError:
                loaded = None
            if loaded is not None and loaded.device.type != "meta" \
                    and (dtype is None or loaded.dtype == dtype) \
                    and (device is None or loaded.device == torch.device(device)):
                return loaded.detach()
        return self.source.tensor(resolved, dtype=dtype, device=device)

    def parameter(self, name, dtype=None, device=None):
        """The tensor for a plain (not replaced) module's own parameter ``name``, in the module's own
        layout.  Differs from ``tensor`` only for an experts module whose layout is not the stacked
        one the sources serve (gpt-oss: transposed, gate/up interleaved), where the stacked tensors
        of a GGUF or per-expert source share its parameters' names: those are converted here."""
        base, _, leaf = name.rpartition(".")
        layout = None
        if leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias") and base.endswith("experts"):
            layout = ExpertsLayout.of(self.model.get_submodule(base))
        if layout is None or layout.stacked or self.source.stores_parameter(name):
            return self.tensor(name, dtype=dtype, device=device)
        load = lambda leaf: self.source.tensor(f"{base}.{leaf}", dtype=dtype, device=device)  # noqa: E731
        if leaf == "down_proj":
            return layout.down_param(load("down_proj")).contiguous()
        if leaf == "gate_up_proj":
            return layout.gate_up_param(load("gate_proj"), load("up_proj"))
        return layout.gate_up_bias_param(load("gate_proj_bias"), load("up_proj_bias"))

    def raw(self, name):
        return self.source.raw(self._name(name))

    def ggml_type(self, name):
        """The stored ggml type id of ``name`` (``formats.stored_type``), from the file's header where the
        source can say (GGUF, FP8 over GGUF): the plan decides formats without reading a tensor."""
        name = self._name(name)
        probe = getattr(self.source, "ggml_type", None)
        if callable(probe):
            return probe(name)
        raw = self.source.raw(name)
        return raw.type.id if raw is not None and raw.type is not None else None

    def stores_parameter(self, name):
        return self.source.stores_parameter(self._name(name))


@dataclass
class LoadReport:
    seconds: float
    bytes_per_device: dict[str, int]

    def summary(self) -> str:
        per = ", ".join(f"{d}: {b / 2**30:.2f} GiB" for d, b in sorted(self.bytes_per_device.items()))
        return f"loaded weights in {self.seconds:.1f} s ({per})"


class _HeldBytes:
    """Bytes the loaded model holds per device, each block of memory once: a tied head reading the
    embedding's bytes (in place from the file, or the very tensor) adds nothing of its own."""

    def __init__(self):
        self.per_device: dict[str, int] = {}
        self._seen: set[tuple[str, int, int]] = set()  # (device, address, bytes)

    def add(self, device: str, nbytes: int, arrays=()) -> None:
        """Count ``nbytes`` on ``device`` less those of ``arrays`` (what holds them) already counted."""
        shared = 0
        for key in {(device, *_memory_block(a)) for a in arrays}:
            if key in self._seen:
                shared += key[2]
            else:
                self._seen.add(key)
        self.per_device[device] = self.per_device.get(device, 0) + max(nbytes - shared, 0)


def _memory_block(a) -> tuple[int, int]:
    """(address, bytes) of a tensor or numpy array."""
    if isinstance(a, torch.Tensor):
        return a.data_ptr(), a.numel() * a.element_size()
    return a.__array_interface__["data"][0], int(a.nbytes)


def _held_arrays(op) -> list:
    """The tensors and numpy arrays an op holds as attributes."""
    import numpy as np

    return [v for v in vars(op).values() if isinstance(v, (torch.Tensor, np.ndarray))]


def inject(
    model: nn.Module,
    rules,
    weights,
    *,
    default_device: str | torch.device = "cpu",
    allow_unmatched: bool = False,
    progress: bool = False,
    lora=None,
    plan: Plan | None = None,
) -> nn.Module:
    """Replace modules of ``model`` as ``rules`` say, then load ``weights`` onto their devices.

    ``model`` is an unmodified transformers model built on the meta device (see
    ``build_model``); ``rules`` a rule-file path, YAML string or list of rule dicts;
    ``weights`` a path (GGUF or safetensors) or a ``WeightSource``.  Returns the same model,
    with ``model.kt_plan`` (the placement) and ``model.kt_load_report`` attached.  A rule that
    matches no module is an error unless ``allow_unmatched=True``.  ``lora`` names a PEFT-format
    LoRA adapter folder applied once the weights are in (``ktransformers.util.peft_adapter``).
    ``plan``: the plan of ``rules`` on this very model, when the caller made it already (the load
    pipeline checks it before reading any weight); it is not made twice.
    """
    source = weights if isinstance(weights, WeightSource) else open_weights(weights)
    if plan is None:
        plan = plan_model(model, rules, default_device)
    elif plan.placements.get("") is None or plan.placements[""].module_class != type(model).__name__:
        raise ValueError(f"inject: the plan given was made for another model, not {type(model).__name__}")
    if not allow_unmatched:
        unmatched = plan.unmatched_rules()
        if unmatched:
            r = unmatched[0]
            raise RuleError(f"{r.where()}: matches no module of {type(model).__name__} ({r.describe_match()})")
    check_devices_available(plan)
    check_transfer_maps(plan)
    plan.decide_formats(model, ModelWeights(source, model))  # once: a plan explained already has them
    apply_plan(model, plan, source)
    report = load_weights(model, plan, source, progress=progress)
    install_device_hooks(model, plan)
    install_prefill_threads(model)
    use_cpu_attention(model)
    use_prompt_rope(model)
    use_fast_norms(model)
    use_cpu_linear_attention(model)
    use_fused_mlp(model)
    model.kt_plan = plan
    model.kt_load_report = report
    model.kt_weights = source
    if lora is not None:
        apply_adapter(model, lora)
    return model


def optimize_and_load_gguf(model, rule_file, gguf_path, config=None, default_device="cpu"):
    """The reference system's entry point, kept for existing scripts: ``inject`` that, like the
    reference system, lets rules match nothing."""
    return inject(model, rule_file, gguf_path, default_device=default_device, allow_unmatched=True)


def check_transfer_maps(plan: Plan) -> None:
    """A ``transfer_map`` (reference-system kwarg of the model operator) must agree with where
    the rules put each layer; a disagreement is an error instead of a silent surprise."""
    for p in plan.injected():
        tmap = p.kwargs.get("transfer_map")
        if not tmap:
            continue
        layers = sorted(
            (int(n.rsplit(".", 1)[1]), q) for n, q in plan.placements.items()
            if n.startswith(f"{p.name}.layers.") and n.count(".") == p.name.count(".") + 2
        )
        current = p.generate_device
        for idx, place in layers:
            if idx in tmap:
                current = torch.device(tmap[idx])
            if place.generate_device != current:
                raise RuleError(
                    f"{p.rule.where('replace.kwargs')}: transfer_map puts layer {idx} on {current}, but the rules "
                    f"place '{place.name}' on {place.generate_device}"
                )


def apply_plan(model: nn.Module, plan: Plan, source=None) -> None:
    """Swap in the operators of the plan, top-down (children of replaced modules keep their names)."""
    for p in plan.injected():
        orig = model.get_submodule(p.name) if p.name else model
        if issubclass(p.operator, BaseInjectedModule):
            decided = {"phases": p.phases, "formats": p.formats}  # construction reads the plan's decisions
        else:  # a third-party module: the rule's op names as written
            decided = {k: p.rule.kwargs[k] for k in ("generate_op", "prefill_op") if k in p.rule.kwargs}
        try:
            new = p.operator(
                key=p.name, gguf_loader=source, config=model.config, orig_module=orig,
                prefill_device=p.prefill_device, generate_device=p.generate_device, **decided, **p.kwargs,
            )
        except KTError as e:
            raise RuleError(f"{p.rule.where()}: {e}") from None
        except TypeError as e:
            raise RuleError(f"{p.rule.where()}: cannot build {p.operator.__name__} for '{p.name}': {e}") from None
        if not p.name:
            raise RuleError(f"{p.rule.where()}: the root model itself cannot be replaced; match 'model' instead")
        parent_name, _, leaf = p.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, new)


def load_weights(model: nn.Module, plan: Plan, source: WeightSource, progress: bool = False) -> LoadReport:
    weights = ModelWeights(source, model)
    t0 = time.perf_counter()
    held = _HeldBytes()
    modules = list(model.named_modules())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(modules), desc="loading weights", unit="module", leave=False)
    for name, module in modules:
        place = plan.placements.get(name)
        if place is None:
            raise WeightError(f"module '{name}' has no placement (it was added after planning)")
        device = place.generate_device
        decided = place.formats.get("generate", {})  # a plain module's own tensors: the plan's float copies
        if isinstance(module, BaseInjectedModule) and module.OPS is not None:
            try:
                module.load(weights, module_dtype(module))
            except KTError:
                raise
            for op in module.ops():
                held.add(str(op.device), op.nbytes(), _held_arrays(op))
        for pname, param in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            dtype = _decided_dtype(decided, full, param)
            t = weights.parameter(full, dtype=dtype, device=device)
            if tuple(t.shape) != tuple(param.shape):
                raise WeightError(
                    f"{source.path}: tensor '{full}' has shape {list(t.shape)}, the model expects {list(param.shape)}"
                )
            module._parameters[pname] = nn.Parameter(t, requires_grad=False)
            held.add(str(device), t.numel() * t.element_size(), [t])
        for bname, buf in list(module.named_buffers(recurse=False)):
            full = f"{name}.{bname}" if name else bname
            persistent = bname not in module._non_persistent_buffers_set
            if persistent and weights.has(full):
                t = weights.tensor(full, dtype=_decided_dtype(decided, full, buf), device=device)
            elif buf.device.type != "meta":
                t = buf.to(device)
            else:
                t = None  # recomputed below
            if t is not None:
                module._buffers[bname] = t
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    _rebuild_meta_buffers(model, plan)
    _share_tied_weights(model, weights)
    _check_nothing_on_meta(model)
    return LoadReport(time.perf_counter() - t0, held.per_device)


def _decided_dtype(decided: dict, full: str, t: torch.Tensor) -> torch.dtype | None:
    """The dtype tensor ``full`` is read in: its plan format's (``plan.plain_formats``), else the
    model's own for a float tensor the plan did not see, else as stored (integers)."""
    fmt = decided.get(full)
    if fmt is not None:
        return fmt.torch_dtype
    return t.dtype if t.is_floating_point() else None


def _rebuild_meta_buffers(model: nn.Module, plan: Plan) -> None:
    """Non-persistent buffers of a model built under ``torch.device('meta')`` (rotary tables)
    cannot come from a checkpoint: compute them from a parameter-free copy of the model."""
    missing = [(n, m, b) for n, m in model.named_modules() for b, t in m.named_buffers(recurse=False)
               if t.device.type == "meta"]
    if not missing:
        return
    shadow = build_model(model.config)
    shadow_bufs = dict(shadow.named_buffers())
    for name, module, bname in missing:
        full = f"{name}.{bname}" if name else bname
        if full not in shadow_bufs or shadow_bufs[full].device.type == "meta":
            raise WeightError(f"buffer '{full}' is not in the weights and cannot be recomputed")
        module._buffers[bname] = shadow_bufs[full].to(plan.placements[name].generate_device)


def _share_tied_weights(model: nn.Module, weights: ModelWeights) -> None:
    for dst, src in weights.aliases.items():
        if weights.source.has(dst):
            continue
        try:
            dst_mod, _, dst_p = dst.rpartition(".")
            src_mod, _, src_p = src.rpartition(".")
            a = model.get_submodule(dst_mod)
            b = model.get_submodule(src_mod)
        except AttributeError:
            continue
        pa, pb = a._parameters.get(dst_p), b._parameters.get(src_p)
        if pa is not None and pb is not None and pa.device == pb.device and pa.dtype == pb.dtype \
                and pa.shape == pb.shape:
            a._parameters[dst_p] = pb  # one copy in memory


def _check_nothing_on_meta(model: nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        more = f" and {len(left) - 5} more" if len(left) > 5 else ""
        raise WeightError(f"not loaded (still on the meta device): {', '.join(left[:5])}{more}")


def install_device_hooks(model: nn.Module, plan: Plan) -> None:
    """Move a module's inputs to its device where its placement differs from its parent's.

    Operators with ops move their own inputs; plain modules get a forward pre-hook, only at
    the boundaries, so modules on the same device as their parent pay nothing.
    """
    def hook_for(device: torch.device):
        def pre_hook(module, args, kwargs):
            return move_to(args, device), move_to(kwargs, device)

        return pre_hook

    handles = []
    mods = dict(model.named_modules())
    for name, module in mods.items():
        if isinstance(module, BaseInjectedModule) and module.OPS is not None:
            continue
        place = plan.placements[name]
        parent_name = name.rpartition(".")[0] if name else None
        parent_dev = plan.placements[parent_name].generate_device if parent_name is not None else torch.device("cpu")
        if place.generate_device != parent_dev:
            handles.append(module.register_forward_pre_hook(hook_for(place.generate_device), with_kwargs=True))
    model.kt_hook_handles = handles
