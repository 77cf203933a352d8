"""Names in rule files → classes.

``replace.class`` accepts a registered short name (``KTransformersLinear``), a dotted path
(``ktransformers.operators.linear.KTransformersLinear``, also the reference system's paths),
or ``default``.  ``match.class`` accepts a dotted path (``torch.nn.Linear``,
``transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts``, the reference system's
``ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE``) or a bare class name, which
matches any module whose class (or a base class) has that name.
"""

from __future__ import annotations

import difflib
import importlib

from torch import nn

from ..errors import RuleError

# operators the reference system has and this project does not, with what to use instead
MISSING_OPERATORS = {
    "KLinearMarlin": "KLinearTorch (any device) or KLinearCPU (quantized weights on the CPU)",
    "VLinearMarlin": "KLinearTorch (any device) or KLinearCPU (quantized weights on the CPU)",
    "KLinearQ8": "KLinearCPU with a Q8_0 weight, or KLinearTorch",
    "KLinearIPEXLLM": "KLinearTorch",
    "KExpertsMarlin": "KExpertsTorch on the GPU",
    "KLlamaAttention": "default (keep the transformers attention)",
    "flashinfer_attn": "default (keep the transformers attention)",
    "KQwen2MoeAttention": "default (keep the transformers attention)",
    "KQwen3MoeAttention": "default (keep the transformers attention)",
    "KQwen3MoeAttentionIPEXLLM": "default (keep the transformers attention)",
    "KMoEGateIPEXLLM": "KMoEGate or default",
}


def _short_names() -> dict[str, type]:
    from ..operators import all_operators

    return all_operators()


def resolve_operator(text: str) -> type[nn.Module] | None:
    """Class for ``replace.class`` (None for ``default``); RuleError with a suggestion otherwise."""
    if text == "default":
        return None
    shorts = _short_names()
    if text in shorts:
        return shorts[text]
    leaf = text.rpartition(".")[2]
    if "." in text:
        cls = _import_dotted(text)
        if cls is not None:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise RuleError(f"'{text}' is not a torch.nn.Module class")
            return cls
    raise RuleError(_unknown(text, leaf, shorts))


def resolve_match_class(text: str) -> type | str:
    """Class for ``match.class``; a bare name is returned as a string and matched by class name."""
    if "." not in text:
        return text
    cls = _import_dotted(text)
    if cls is None:
        raise RuleError(f"class '{text}' cannot be imported{_did_you_mean_module(text)}")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise RuleError(f"'{text}' is not a torch.nn.Module class")
    return cls


def suggest_op(family: str, name: str, known: list[str]) -> str:
    msg = f"{family} has no op '{name}'"
    if name in MISSING_OPERATORS:
        msg += f" (this project does not provide it; use {MISSING_OPERATORS[name]})"
    else:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        if near:
            msg += f"; did you mean '{near[0]}'?"
    return msg + f" Known ops: {', '.join(known)}"


def _import_dotted(text: str):
    mod_name, _, attr = text.rpartition(".")
    try:
        mod = importlib.import_module(mod_name)
    except (ImportError, TypeError, ValueError):  # also ".." or "a..b": not a module path
        return None
    return getattr(mod, attr, None)


def _unknown(text: str, leaf: str, shorts: dict[str, type]) -> str:
    if leaf in MISSING_OPERATORS:
        return f"operator '{text}' is not provided by this project; use {MISSING_OPERATORS[leaf]}"
    near = difflib.get_close_matches(leaf, list(shorts), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else f" (operators: {', '.join(sorted(shorts))})"
    return f"operator class '{text}' not found{hint}"


def _did_you_mean_module(text: str) -> str:
    mod_name = text.rpartition(".")[0]
    try:
        importlib.import_module(mod_name)
    except (ImportError, TypeError, ValueError):
        return f" ('{mod_name}' is not an importable module)"
    mod = importlib.import_module(mod_name)
    leaf = text.rpartition(".")[2]
    names = [n for n in dir(mod) if isinstance(getattr(mod, n, None), type)]
    near = difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
    return f"; did you mean '{mod_name}.{near[0]}'?" if near else f" (no class '{leaf}' in {mod_name})"
