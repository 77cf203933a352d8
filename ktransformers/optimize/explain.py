"""The explain view: what each rule matched and where every weight goes, without loading any.

``explain_plan`` returns the data (for tests and tools); ``format_explanation`` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from ..operators.formats import RAW, stored_type
from .plan import Plan


@dataclass
class Row:
    module: str
    module_class: str
    operator: str
    rule: int | None
    prefill: str  # "device/op"
    generate: str
    bytes_per_device: dict[str, int]
    #: how its ops hold their weights (``Placement.formats``, ``format_label``); "" without weights
    format: str = ""


@dataclass
class TensorRow:
    """One weight as the plan holds it (``Placement.formats``)."""

    tensor: str
    stored: str  # its ggml type in the file's header ("-": plain floats, FP8, or computed from stored values)
    format: str  # ``WeightFormat.label``; ``… | prefill: …`` where a prefill op holds its own copy otherwise
    devices: str  # where it is held, ``cpu`` / ``cpu+cuda:0``
    module: str  # the module whose op (or, for a plain module, the loader) holds it


@dataclass
class Explanation:
    rule_counts: list[tuple[int, str, int, str]]  # (index, where, count, description)
    rows: list[Row]
    bytes_per_device: dict[str, int]
    unmatched: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # reference-system names used, one line each
    memory: "MemoryPlan | None" = None
    #: every weight whose format the plan decided, in module order (empty without weights)
    tensors: list[TensorRow] = field(default_factory=list)


@dataclass
class MemoryPlan:
    """What a load will hold: host memory, and each accelerator's.

    ``in_place``: stored bytes the kernels read from the mapped weight file (page cache, read as
    used); ``copies``: tensors converted into the model's dtype (private memory); ``packed``:
    packed expert copies a first load makes (each layer written to the packed-weight cache and
    then mapped, so at most ``packed_layer`` is private at a time; all of it private without a
    cache); ``packed_cached``: packed copies already in the cache (mapped).  ``kv_cache``: the
    host-placed KV cache at ``context`` tokens; part of the peak only when the context was chosen
    (``context_chosen``; otherwise the cache grows with the conversation and ``context`` is the
    model's own limit).  ``runtime``: what this process holds already (torch, transformers, the
    CPU kernels), outside ``available``, the machine's MemAvailable (None when unknown).
    ``devices``: accelerator -> ``[weights, KV cache, free bytes or None]``."""

    in_place: int = 0
    copies: int = 0
    packed: int = 0
    packed_layer: int = 0
    packed_cached: int = 0
    cache_on: bool = True
    available: int | None = None
    kv_cache: int = 0
    context: int | None = None
    context_chosen: bool = False
    runtime: int | None = None
    devices: dict[str, list] = field(default_factory=dict)

    def add(self, nbytes: int, how: str) -> None:
        if how == "in_place":
            self.in_place += nbytes
        elif how == "packed":
            self.packed += nbytes
            self.packed_layer = max(self.packed_layer, nbytes)
        elif how == "packed_cached":
            self.packed_cached += nbytes
        else:
            self.copies += nbytes

    @property
    def private(self) -> int:
        """Private memory the load needs at its peak (with the KV cache of a chosen context)."""
        return (self.copies + (self.packed_layer if self.cache_on else self.packed)
                + (self.kv_cache if self.context_chosen else 0))

    @property
    def mapped(self) -> int:
        return self.in_place + self.packed_cached + (self.packed if self.cache_on else 0)

    def device_needs(self, dev: str) -> int:
        """Bytes an accelerator needs: its weights, and its KV cache when the context was chosen."""
        weights, kv, _ = self.devices[dev]
        return weights + (kv if self.context_chosen else 0)

    def short_devices(self) -> list[tuple[str, int, int]]:
        """(device, needed, free) of each accelerator whose free memory is known and too small."""
        return [(d, self.device_needs(d), free) for d, (_, _, free) in sorted(self.devices.items())
                if free is not None and self.device_needs(d) > free]

    def _kv_words(self, kv: int) -> str:
        if self.context is None:
            return ""
        if self.context_chosen:
            return f"KV cache at {self.context} tokens {fmt_bytes(kv)}"
        return f"KV cache up to {fmt_bytes(kv)} (grows with the conversation to the model's {self.context} tokens)"

    def lines(self) -> list[str]:
        parts = [f"read in place from the weights {fmt_bytes(self.in_place)}", f"copies {fmt_bytes(self.copies)}"]
        if self.packed:
            parts.append(f"packed experts made on this load {fmt_bytes(self.packed)}"
                         + (" (written to the packed-weight cache, then mapped)" if self.cache_on else " (no cache: kept)"))
        if self.packed_cached:
            parts.append(f"packed experts mapped from the cache {fmt_bytes(self.packed_cached)}")
        if self.context is not None and (self.kv_cache or not self.devices):
            parts.append(self._kv_words(self.kv_cache))
        if self.runtime is not None:
            parts.append(f"runtime (torch, transformers, CPU kernels: this process now) {fmt_bytes(self.runtime)}")
        out = ["Memory plan (host): " + "; ".join(parts) + "."]
        if self.available is not None:
            verdict = ("fits" if self.private + self.mapped <= self.available else
                       "fits; the mapped part pages from disk when memory runs short"
                       if self.private <= self.available else "does NOT fit")
            out.append(f"  private memory at the peak {fmt_bytes(self.private)}, mapped "
                       f"{fmt_bytes(self.mapped)}; this machine has {fmt_bytes(self.available)} available: {verdict}")
        for dev, (weights, kv, free) in sorted(self.devices.items()):
            words = [f"weights {fmt_bytes(weights)}"] + ([self._kv_words(kv)] if self.context is not None else [])
            room = "" if free is None else (f"; {fmt_bytes(free)} free: "
                                            + ("fits" if self.device_needs(dev) <= free else "does NOT fit"))
            out.append(f"Memory plan ({dev}): " + "; ".join(words) + room + ".")
        return out


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def explain_plan(model: nn.Module, plan: Plan, weights=None, context: int | None = None) -> Explanation:
    """Per rule: modules matched; per matched module: operator, devices/ops and bytes placed.

    Bytes are those of the module's parameters and persistent buffers not claimed by a
    deeper matched module; an operator whose prefill op lives elsewhere holds a copy on both
    devices.  With ``weights`` (a WeightSource), quantized tensors that an op keeps as stored
    are counted at their stored size.  The memory plan sizes the KV cache at ``context`` tokens
    (a chosen context, part of the peak), else at the model's own limit (reported, not counted).
    """
    from .inject import ModelWeights, tied_weight_aliases

    if weights is not None:
        plan.decide_formats(model, ModelWeights(weights, model))  # a plan from plan_load has them already
    owner: dict[str, str] = {}  # module name -> name of the placement row that owns its bytes
    rows: dict[str, Row] = {}
    for name, p in plan.placements.items():
        if p.rule is not None or not name:
            rows[name] = Row(
                module=name or "<model>", module_class=p.module_class, operator=p.operator_name,
                rule=p.rule.index if p.rule else None,
                prefill=p.phases.label("prefill", p.operator_name), generate=p.phases.label("generate", p.operator_name),
                bytes_per_device={}, format=format_label(p.formats, name),
            )
            owner[name] = name
        else:
            parent = name.rpartition(".")[0]
            owner[name] = owner.get(parent, "")
    totals: dict[str, int] = {}
    mem = _memory_header()
    # operators that say how they hold their weights (the experts: stored blocks, or a packed copy)
    held: dict[str, tuple[int, str]] = {}
    for name, p in plan.placements.items():
        fn = getattr(p.phases.generate_op, "memory_plan", None)
        got = fn(name, p.kwargs, weights, p.formats.get("generate", {})) if fn is not None and p.rule is not None \
            else None
        if got is not None:
            held[name] = got
    # a tied parameter the weights do not hold on their own is the one it is tied to
    aliases = {a: b for a, b in tied_weight_aliases(model).items() if not _stored_apart(weights, a, b)}
    counted: set[tuple] = set()  # (tensor, read in place?, device)
    tied: dict[str, str] = {}  # tensor -> the tensor whose bytes it shares
    modules = dict(model.named_modules())
    for name, module in modules.items():
        p = plan.placements.get(name)
        if p is None:
            continue
        row = rows[owner[name]]
        tensors = [(f"{name}.{n}" if name else n, t) for n, t in module.named_parameters(recurse=False)]
        tensors += [(f"{name}.{n}" if name else n, t) for n, t in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set]
        op_devices = p.phases.weight_devices()
        on_cpu = any(torch.device(d).type == "cpu" for d in op_devices)
        if owner[name] in held:
            if name == owner[name]:  # the operator's own figure, once for the module
                nbytes, how = held[name]
                tensors = []
                for dev in op_devices:
                    row.bytes_per_device[str(dev)] = row.bytes_per_device.get(str(dev), 0) + nbytes
                    totals[str(dev)] = totals.get(str(dev), 0) + nbytes
                if on_cpu:
                    mem.add(nbytes, how)
            else:
                tensors = []
        for full, t in tensors:
            nbytes, in_place = _stored_bytes(weights, full, t, p)
            for dev in op_devices:
                # a tied head read in place from the embedding's bytes, or sharing its copy on
                # one device, is held once
                key = (aliases.get(full, full), in_place, str(dev))
                if key in counted:
                    tied[full] = key[0]
                    continue
                counted.add(key)
                row.bytes_per_device[str(dev)] = row.bytes_per_device.get(str(dev), 0) + nbytes
                totals[str(dev)] = totals.get(str(dev), 0) + nbytes
                if torch.device(dev).type == "cpu":
                    mem.add(nbytes, "in_place" if in_place else "copy")
    _add_kv_and_devices(mem, model, plan, totals, context)
    counts = [(r.index, r.where(), len(plan.matches.get(r.index, [])), r.describe_match()) for r in plan.rules]
    unmatched = [r.index for r in plan.unmatched_rules()]
    return Explanation(counts, list(rows.values()), totals, unmatched,
                       notes=plan.absent_kind_notes() + _kv_cache_notes(model)
                       + [f"{a} is {b} (tied): counted once, under {b.rpartition('.')[0]}" for a, b in tied.items()],
                       aliases=alias_lines(plan.rules), memory=mem,
                       tensors=tensor_rows(plan, ModelWeights(weights, model)) if weights is not None else [])


def tensor_rows(plan: Plan, weights) -> list[TensorRow]:
    """Each weight the plan decided a format for: its stored type (from the header), the format and
    the devices holding it (both of an op whose prefill copy lives elsewhere)."""
    out = []
    for name, p in plan.placements.items():
        gen, pre = p.formats.get("generate", {}), p.formats.get("prefill", {})
        devices = "+".join(str(d) for d in p.phases.weight_devices())
        for tensor, fmt in gen.items():
            label = fmt.label
            if tensor in pre and pre[tensor] != fmt:
                label += f" | prefill: {pre[tensor].label}"
            stored = stored_type(weights, tensor)
            out.append(TensorRow(tensor, stored.name if stored is not None else "-", label, devices, name))
    return out


def compact_tensor_rows(rows: list[TensorRow]) -> list[TensorRow]:
    """Tensor rows that differ only in layer numbers folded into one (``model.layers.*.mlp.experts.down_proj  (x2)``)."""
    import re

    groups: dict[tuple, TensorRow] = {}
    counts: dict[tuple, int] = {}
    for r in rows:
        key = (re.sub(r"\.\d+(?=\.|$)", ".*", r.tensor), r.stored, r.format, r.devices)
        if key not in groups:
            groups[key] = TensorRow(key[0], r.stored, r.format, r.devices, re.sub(r"\.\d+(?=\.|$)", ".*", r.module))
            counts[key] = 0
        counts[key] += 1
    for key, row in groups.items():
        if counts[key] > 1:
            row.tensor = f"{row.tensor}  (x{counts[key]})"
    return list(groups.values())


def _memory_header() -> "MemoryPlan":
    from ..kernels.packed_cache import cache_dir
    from ..kernels.pool import free_host_bytes, resident_bytes

    return MemoryPlan(cache_on=cache_dir() is not None, available=free_host_bytes(), runtime=resident_bytes())


def model_context(model: nn.Module) -> int:
    """The most tokens the model's positions allow (its config's ``max_position_embeddings``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 0) or 4096)


def kv_cache_bytes(model: nn.Module, plan: Plan, tokens: int) -> dict[str, int]:
    """Device -> bytes of the KV cache at ``tokens`` tokens of context, per attention layer where
    its module is placed: keys and values of each KV head (MLA: the latent and rope key), for the
    tokens transformers' static cache gives the layer (a sliding window holds at most its window).
    Linear-attention layers keep a fixed state and are not counted."""
    from transformers import StaticCache

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        lengths = [getattr(la, "max_cache_len", None) for la in StaticCache(config=model.config,
                                                                           max_cache_len=tokens).layers]
    except (KeyError, ValueError, TypeError, AttributeError):  # layer kinds only the model's own dynamic cache holds
        lengths = []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    elt = torch.empty((), dtype=dtype).element_size()
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        if not name.endswith("self_attn") or not hasattr(mod, "layer_idx"):
            continue
        i = int(mod.layer_idx)
        n = lengths[i] if i < len(lengths) and lengths[i] is not None else tokens
        if hasattr(mod, "kv_lora_rank"):
            width = int(mod.kv_lora_rank) + int(mod.qk_rope_head_dim)
        else:
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            head_dim = int(getattr(mod, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
            width = 2 * kv_heads * head_dim
        p = plan.placements.get(name)
        dev = str(p.generate_device) if p is not None else "cpu"
        out[dev] = out.get(dev, 0) + width * int(n) * elt
    return out


def _device_free(dev: str) -> int | None:
    """Free bytes of an accelerator (torch's CUDA memory info), or None when it cannot tell."""
    d = torch.device(dev)
    if d.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.mem_get_info(d)[0])
    except (RuntimeError, AssertionError, ValueError):
        return None


def _add_kv_and_devices(mem: MemoryPlan, model: nn.Module, plan: Plan, totals: dict[str, int],
                        context: int | None) -> None:
    limit = model_context(model)
    if context is not None and not 1 <= context <= limit:
        raise ConfigError(f"context of {context} tokens: expected 1 to {limit} (the model's "
                          f"max_position_embeddings)")
    mem.context = context if context is not None else limit
    mem.context_chosen = context is not None
    kv = kv_cache_bytes(model, plan, mem.context)
    for dev, nbytes in kv.items():
        if torch.device(dev).type == "cpu":
            mem.kv_cache += nbytes
    for dev in sorted(set(totals) | set(kv)):
        if torch.device(dev).type != "cpu":
            mem.devices[dev] = [totals.get(dev, 0), kv.get(dev, 0), _device_free(dev)]


def alias_lines(rules) -> list[str]:
    """One line per reference-system name the rules used: ``KLinearMarlin → KLinearGPUQ (GPU quantized linear)``."""
    seen: dict[tuple[str, str], str] = {}
    for r in rules:
        for theirs, ours, what in r.aliases:
            seen.setdefault((theirs, ours), what)
    return [f"{theirs} → {ours} ({what})" for (theirs, ours), what in seen.items()]


def _kv_cache_notes(model: nn.Module) -> list[str]:
    """MLA models: the latent cache per token next to what expanded per-head K/V would take."""
    from ..operators.mla import latent_cache_bytes_per_token

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(cfg, "kv_lora_rank", None):
        return []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    lat, exp = latent_cache_bytes_per_token(cfg, dtype)
    return [f"KV cache per token ({str(dtype).removeprefix('torch.')}, all layers): MLA latent "
            f"{fmt_bytes(lat)} (per-head K/V would be {fmt_bytes(exp)}, {exp / lat:.0f}x)"]


def _stored_apart(weights, a: str, b: str) -> bool:
    """Whether ``weights`` store tensor ``a`` apart from ``b`` (a GGUF serves a tied head from the
    embedding's own bytes)."""
    if weights is None or not weights.has(a):
        return False
    name_of = getattr(weights, "gguf_name", None)
    return name_of is None or name_of(a) != name_of(b)


def _stored_bytes(weights, full: str, t: torch.Tensor, p) -> tuple[int, bool]:
    """(bytes, read in place from the file?) of one tensor as its generate op holds it: raw blocks at
    their stored size, anything else as the model's tensor."""
    fmt = p.formats.get("generate", {}).get(full) if weights is not None else None
    if fmt is not None and fmt.kind == RAW:
        return fmt.type.nbytes(t.shape), True
    return _tensor_bytes(t), False


def format_label(formats: dict[str, dict], module: str) -> str:
    """One cell naming each weight's format (``operators/formats.py``): ``raw Q4_K`` when every weight of
    the module has it, else ``gate_proj,up_proj raw Q4_K; down_proj raw Q6_K``; a prefill op holding its
    own copy in another format is added as ``| prefill: …``."""
    def cell(fmts: dict) -> str:
        groups: dict[str, list[str]] = {}
        for name, fmt in fmts.items():
            leaf = name[len(module) + 1:] if name.startswith(f"{module}.") else name
            groups.setdefault(fmt.label, []).append(leaf)
        if len(groups) == 1:
            return next(iter(groups))
        return "; ".join(f"{','.join(names)} {label}" for label, names in groups.items())

    gen = cell(formats.get("generate", {}))
    pre = cell(formats.get("prefill", {}))
    return gen if not pre or pre == gen else f"{gen} | prefill: {pre}"


def fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def compact_rows(rows: list[Row]) -> list[Row]:
    """Rows that differ only in layer numbers folded into one (``model.layers.*.mlp  x61``)."""
    import re

    groups: dict[tuple, Row] = {}
    counts: dict[tuple, int] = {}
    for r in rows:
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", r.module)
        key = (pattern, r.module_class, r.operator, r.rule, r.prefill, r.generate, r.format)
        if key not in groups:
            groups[key] = Row(pattern, r.module_class, r.operator, r.rule, r.prefill, r.generate, {}, r.format)
            counts[key] = 0
        counts[key] += 1
        for d, b in r.bytes_per_device.items():
            groups[key].bytes_per_device[d] = groups[key].bytes_per_device.get(d, 0) + b
    out = []
    for key, row in groups.items():
        if counts[key] > 1:
            row.module = f"{row.module}  (x{counts[key]})"
        out.append(row)
    return out


def format_explanation(ex: Explanation, compact: bool = False) -> str:
    out = []
    if ex.aliases:
        out.append("Reference-system names:")
        out += [f"  {line}" for line in ex.aliases]
        out.append("")
    out.append("Rules:")
    for index, where, count, desc in ex.rule_counts:
        flag = "  <-- matches nothing" if count == 0 else ""
        out.append(f"  #{index:<3} {count:>5} module(s)  {desc}  [{where}]{flag}")
    out.append("")
    headers = ("module", "class", "operator", "rule", "prefill device/op", "generate device/op", "weight format",
               "bytes")
    table = [
        (r.module, r.module_class, r.operator, "-" if r.rule is None else f"#{r.rule}", r.prefill, r.generate,
         r.format or "-", ", ".join(f"{d} {fmt_bytes(b)}" for d, b in sorted(r.bytes_per_device.items())) or "-")
        for r in (compact_rows(ex.rows) if compact else ex.rows)
    ]
    out += _table(headers, table)
    if ex.tensors:
        out.append("")
        out.append("Weight format per tensor:")
        out += _table(("tensor", "stored", "format", "held on"),
                      [(r.tensor, r.stored, r.format, r.devices)
                       for r in (compact_tensor_rows(ex.tensors) if compact else ex.tensors)])
    out.append("")
    out.append("Parameter bytes per device: " + (", ".join(
        f"{d}: {fmt_bytes(b)}" for d, b in sorted(ex.bytes_per_device.items())) or "none"))
    for note in ex.notes:
        out.append(note)
    if ex.memory is not None:
        out += ex.memory.lines()
    return "\n".join(out)


def _table(headers: tuple[str, ...], table: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return out
