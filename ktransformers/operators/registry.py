"""Names in rule files -> operator and op classes: the one registry.

Operators and ops register the same way, with ``@register("Name", ...)`` naming the rule
names they answer to.  An operator lands in :data:`OPERATORS`; an op in its family's table
(``LinearOp.TABLE``, ``ExpertsOp.TABLE``), which the family's operator exposes as ``OPS``.
The reference system's names are not registered here: they resolve through :mod:`.compat`.

``replace.class`` accepts a registered name (``KTransformersLinear``), a dotted path under
``ktransformers.operators.`` (its leaf is looked up, whatever the module: the reference
system's ``ktransformers.operators.balance_serve_attention.KQwen3MoeAttention`` too), a dotted
path to an ``nn.Module`` in a package rule files may import (:func:`import_rule_attribute`),
or ``default``.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass

from torch import nn

from ..errors import RuleError
from . import compat  # noqa: I001 - the compatibility table of reference names
from .kinds import ATTENTION, MLA_ATTENTION, kind_from_name
from .op import Op

OPERATORS: dict[str, type] = {}

#: packages whose modules a rule file's ``class:`` paths may import; importing runs a module's
#: code, so ``check`` on a rule file from elsewhere must not reach any other module
RULE_IMPORT_PACKAGES = ("ktransformers", "transformers", "torch")
#: comma-separated extra packages (your own operators), e.g. ``KT_RULE_IMPORTS=my_ops,lab.kernels``
RULE_IMPORTS_ENV = "KT_RULE_IMPORTS"


def rule_import_packages() -> tuple[str, ...]:
    extra = [p.strip() for p in os.environ.get(RULE_IMPORTS_ENV, "").split(",") if p.strip()]
    return RULE_IMPORT_PACKAGES + tuple(extra)


def import_rule_module(module: str):
    """The module a rule file's dotted path names, imported only inside :func:`rule_import_packages`.

    RuleError for a module outside them; ImportError / ValueError / TypeError as ``import_module``."""
    allowed = rule_import_packages()
    if not any(module == p or module.startswith(p + ".") for p in allowed):
        raise RuleError(f"module '{module}' is outside the packages rule files may import "
                        f"({', '.join(allowed)}); to load operators of your own, set "
                        f"{RULE_IMPORTS_ENV}={module.partition('.')[0]}")
    return importlib.import_module(module)


def import_rule_attribute(path: str):
    """``getattr(import_rule_module(module), leaf)`` of a dotted path, None when it cannot be imported."""
    mod_name, _, attr = path.rpartition(".")
    try:
        return getattr(import_rule_module(mod_name), attr, None)
    except (ImportError, TypeError, ValueError):  # also ".." or "a..b": not a module path
        return None

# modules whose import registers operators and ops; optional ones may be absent in a build
_OPERATOR_MODULES = ("linear", "embedding", "experts", "moe", "gate", "RoPE", "layernorm", "mlp", "models",
                     "attention")
_OPTIONAL_MODULES = ("cpu_experts", "sft_experts", "cpu_linear", "fp8_linear", "gpu_quant_linear")
_loaded = False


def register(*names: str):
    """Class decorator: rules may name this operator (or op) ``names[0]`` or any other of ``names``."""

    def deco(cls):
        if not names:
            raise TypeError("register() needs at least one name")
        if issubclass(cls, Op):
            cls.name = names[0]
            table = cls.TABLE
        else:
            table = OPERATORS
        for n in names:
            table[n] = cls
        return cls

    return deco


def load_all() -> None:
    """Import every operator module once, so that all registrations have run."""
    global _loaded
    if _loaded:
        return
    for name in _OPERATOR_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    for name in _OPTIONAL_MODULES:
        try:
            importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:  # only a missing module of ours is optional
            if e.name != f"{__package__}.{name}":
                raise
    _loaded = True


def operators() -> dict[str, type]:
    load_all()
    return OPERATORS


@dataclass(frozen=True)
class Resolved:
    """What a ``replace.class`` text names: the class (None for ``default``) and the alias used."""

    cls: type | None
    alias: tuple[str, str, str] | None = None  # (reference name, our name, what it does)


def resolve_operator(text: str) -> Resolved:
    """The operator for ``replace.class``; RuleError with a same-kind suggestion otherwise."""
    if text == "default":
        return Resolved(None)
    shorts = operators()
    leaf = text.rpartition(".")[2]
    ours_path = "." not in text or text.startswith(f"{__package__}.")
    if ours_path:
        if leaf in shorts:
            return Resolved(shorts[leaf])
        alias = compat.OPERATORS.get(leaf)
        if alias is not None:
            cls = None if alias.ours == "default" else shorts[alias.ours]
            return Resolved(cls, (leaf, alias.ours, alias.what))
    else:
        cls = import_rule_attribute(text)
        if cls is not None:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise RuleError(f"'{text}' is not a torch.nn.Module class")
            return Resolved(cls)
    raise RuleError(_unknown_operator(text, leaf, shorts))


def resolve_op(operator: type, name: str) -> tuple[type, tuple[str, str, str] | None]:
    """(op class, alias used) for a ``generate_op``/``prefill_op`` value of ``operator``."""
    load_all()
    table = operator.OPS
    if name in table:
        return table[name], None
    alias = compat.op_alias(operator.OP_TABLE_NAME, name, table)
    if alias is not None and alias.ours in table:
        return table[alias.ours], (name, alias.ours, alias.what)
    raise RuleError(suggest_op(operator.__name__, name, sorted(table)))


def suggest_op(family: str, name: str, known: list[str]) -> str:
    msg = f"{family} has no op '{name}'"
    if name in compat.NOT_PROVIDED:
        msg += f" (this project does not provide it; use {compat.NOT_PROVIDED[name]})"
    else:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        if near:
            msg += f"; did you mean '{near[0]}'?"
    return msg + f" Known ops: {', '.join(known)}"


def _unknown_operator(text: str, leaf: str, shorts: dict[str, type]) -> str:
    if leaf in compat.NOT_PROVIDED:
        return f"operator '{text}' is not provided by this project; use {compat.NOT_PROVIDED[leaf]}"
    for table, aliases in compat.OPS.items():
        if leaf in aliases:
            family = next(c.__name__ for c in set(shorts.values()) if getattr(c, "OP_TABLE_NAME", None) == table)
            return (f"operator '{text}' is not provided by this project: {leaf} is an op (here it maps to "
                    f"{compat.op_alias(table, leaf, shorts[family].OPS).ours}); use class: {family} with "
                    f"generate_op: {leaf}")
    names = same_kind_names(leaf, shorts)
    near = difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else f" (operators: {', '.join(sorted(shorts))})"
    return f"operator class '{text}' not found{hint}"


def same_kind_names(text: str, shorts: dict[str, type]) -> list[str]:
    """Operator names (ours and the reference aliases) of the kind ``text`` suggests (all when unclear)."""
    names = list(shorts) + list(compat.OPERATORS)
    kind = kind_from_name(text)
    if kind is None:
        return names

    def kinds(n: str) -> set[str]:
        ours = compat.OPERATORS[n].ours if n in compat.OPERATORS else n
        cls = shorts.get(ours)
        out = set(getattr(cls, "REPLACES", ())) if cls is not None else {kind_from_name(n)}
        return out | {ATTENTION} if MLA_ATTENTION in out else out

    same = [n for n in names if kind in kinds(n)]
    return same or names
