"""Names in rule files -> operator and op classes: the one registry.

Operators and ops register the same way, with ``@register("Name", ...)`` naming the rule
names they answer to.  An operator lands in :data:`OPERATORS`; an op in its family's table
(``LinearOp.TABLE``, ``ExpertsOp.TABLE``), which the family's operator exposes as ``OPS``.
The reference system's names are not registered here: they resolve through :mod:`.compat`.

``replace.class`` accepts a registered name (``KTransformersLinear``), a dotted path under
``ktransformers.operators.`` (its leaf is looked up, whatever the module: the reference
system's ``ktransformers.operators.balance_serve_attention.KQwen3MoeAttention`` too), the
exact path of a registered operator elsewhere in the project, an ``nn.Module`` operator of a
package named in ``KT_RULE_IMPORTS``, or ``default``.

Class paths are resolved, never executed: :func:`rule_module` reaches only the namespaces a
rule may name (:data:`CLASS_NAMESPACES`), and imports only a transformers modeling module
(what building the model imports anyway) or a package the user named in ``KT_RULE_IMPORTS``;
``torch.nn``'s modules are taken as torch imported them.  A ``__main__`` module (a program) is
never a class's home, even in a user's package.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from dataclasses import dataclass

from torch import nn

from ..errors import RuleError
from . import compat  # noqa: I001 - the compatibility table of reference names
from .kinds import ATTENTION, MLA_ATTENTION, kind_from_name
from .op import Op

OPERATORS: dict[str, type] = {}

#: what a rule file's dotted class paths may name (docs/rules.md, "Class paths")
CLASS_NAMESPACES = ("torch.nn", "transformers.models.*.modeling_*", "ktransformers operators")
#: comma-separated extra packages (your own operators), e.g. ``KT_RULE_IMPORTS=my_ops,lab.kernels``
RULE_IMPORTS_ENV = "KT_RULE_IMPORTS"
#: a class path is a handful of identifiers; longer ones are refused before any lookup
#: (importlib recurses once per dotted part: 2000 parts end in RecursionError)
MAX_CLASS_PATH_CHARS = 200
MAX_CLASS_PATH_PARTS = 12

_TORCH_NN = "torch.nn"
_MODELING_MODULE = re.compile(r"transformers\.models\.[A-Za-z0-9_]+\.modeling_[A-Za-z0-9_]+")


def user_rule_packages() -> tuple[str, ...]:
    """The packages (dotted prefixes) named in ``KT_RULE_IMPORTS``."""
    return tuple(p.strip() for p in os.environ.get(RULE_IMPORTS_ENV, "").split(",") if p.strip())


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def check_class_path(text: str) -> list[str]:
    """The dotted parts of a rule's class path; RuleError when it is not one (too long, not
    identifiers, or through a ``__main__`` module)."""
    shown = repr(text if len(text) <= 60 else text[:60] + "...")
    if len(text) > MAX_CLASS_PATH_CHARS or text.count(".") >= MAX_CLASS_PATH_PARTS:
        raise RuleError(f"class path {shown} is longer than a class path is ({MAX_CLASS_PATH_PARTS} dotted parts, "
                        f"{MAX_CLASS_PATH_CHARS} characters at most)")
    parts = text.split(".")
    if not all(p.isidentifier() for p in parts):
        raise RuleError(f"{shown} is not a class path (Python names joined by dots, e.g. torch.nn.Linear)")
    if "__main__" in parts:
        raise RuleError(f"class path {shown} goes through a __main__ module: that is a program to run, "
                        "not a module a class is taken from")
    return parts


def rule_module(module: str):
    """The module a rule's dotted class path names, None when there is no such module.

    Only the namespaces of :data:`CLASS_NAMESPACES` (the ``ktransformers.*`` ones are the caller's:
    the registry and :mod:`.compat`) and the ``KT_RULE_IMPORTS`` packages; RuleError for any other
    module, before anything is imported."""
    check_class_path(module)
    if _under(module, _TORCH_NN):
        return sys.modules.get(module)  # imported with torch; importing more would run torch's tools
    user = next((p for p in user_rule_packages() if _under(module, p)), None)
    if user is None and not _MODELING_MODULE.fullmatch(module):
        top = module.partition(".")[0]
        hint = "" if top in ("torch", "transformers", "ktransformers") else (
            f"; to load operators of your own, set {RULE_IMPORTS_ENV}={top}")
        raise RuleError(f"module '{module}' is outside what rule files may name ({', '.join(CLASS_NAMESPACES)}){hint}")
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a user package's own import-time error, named
        raise RuleError(f"importing '{module}' failed: {type(e).__name__}: {e}") from None


def rule_class(path: str):
    """The attribute a dotted path names inside :func:`rule_module` (None when absent)."""
    mod_name, _, attr = path.rpartition(".")
    mod = rule_module(mod_name) if mod_name else None
    return getattr(mod, attr, None) if mod is not None else None


def registered_class(path: str) -> type | None:
    """The registered operator a ``ktransformers.`` dotted path names: any module under
    ``ktransformers.operators.`` (reference paths name other files), elsewhere its exact path."""
    cls = operators().get(path.rpartition(".")[2])
    if cls is None:
        return None
    if path.startswith(f"{__package__}.") or path == f"{cls.__module__}.{cls.__name__}":
        return cls
    return None


def check_operator_class(text: str, cls) -> None:
    """RuleError unless ``cls`` can be an operator: an ``nn.Module`` class, but neither
    ``nn.Module`` itself nor a whole model (a ``PreTrainedModel``, e.g. ``…ForCausalLM``)."""
    from transformers import PreTrainedModel

    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise RuleError(f"'{text}' is not a torch.nn.Module class")
    if cls is nn.Module or issubclass(cls, PreTrainedModel):
        what = "the base class of every module" if cls is nn.Module else "a whole model"
        raise RuleError(f"'{text}' is {what}, not an operator: replace.class names an operator that replaces one "
                        "module (KTransformersLinear, KTransformersExperts, ...) or 'default'")


# modules whose import registers operators and ops; optional ones may be absent in a build
_OPERATOR_MODULES = ("linear", "embedding", "experts", "moe", "gate", "RoPE", "layernorm", "mlp", "models",
                     "attention")
_OPTIONAL_MODULES = ("cpu_experts", "sft_experts", "cpu_linear", "fp8_linear", "gpu_quant_linear")
#: operators registered outside this package (rule files name them by their full path too)
_OTHER_OPERATOR_MODULES = ("ktransformers.sft.torch_experts",)
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
    for name in _OTHER_OPERATOR_MODULES:
        importlib.import_module(name)
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
    check_class_path(text)
    shorts = operators()
    leaf = text.rpartition(".")[2]
    if "." not in text or text.startswith(f"{__package__}."):
        if leaf in shorts:
            return Resolved(shorts[leaf])
        alias = compat.OPERATORS.get(leaf)
        if alias is not None:
            cls = None if alias.ours == "default" else shorts[alias.ours]
            return Resolved(cls, (leaf, alias.ours, alias.what))
    elif text.startswith("ktransformers."):
        cls = registered_class(text)
        if cls is not None:
            return Resolved(cls)
        if leaf in shorts:
            ours = shorts[leaf]
            raise RuleError(f"operator '{text}' not found; did you mean '{ours.__module__}.{ours.__name__}' "
                            f"(or just '{leaf}')?")
    else:
        if not any(_under(text, p) for p in user_rule_packages()):
            cls = rule_class(text)  # torch.nn / transformers: a module to match, never an operator
            if cls is not None:
                check_operator_class(text, cls)
            raise RuleError(f"'{text}' is not an operator: torch.nn and transformers classes are what a rule "
                            "matches (match.class); replace.class names an operator or 'default'")
        cls = rule_class(text)
        if cls is not None:
            check_operator_class(text, cls)
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
    msg = f"{family} has no op {name!r}"
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
