"""ktransformers: run huge Mixture-of-Experts models on one machine.

Build the unmodified transformers model on the meta device, let a YAML rule file say which
operator (and device, per phase) each module gets, then stream the weights in::

    from ktransformers import build_model, inject
    model = inject(build_model(config), "rules.yaml", "model.gguf")
    model.generate(...)

or in one call: ``model, tokenizer = load("model.gguf")`` (``load_model`` gives the model alone).
"""

__version__ = "0.1.0"

from .errors import ConfigError, KTError, RuleError, WeightError

# torch and transformers load lazily, so a CLI's --help or a bad flag answers at once
_LAZY = {
    "build_model": "optimize", "explain_plan": "optimize", "format_explanation": "optimize",
    "inject": "loading", "optimize_and_load_gguf": "optimize", "plan_model": "optimize",
    "load_config": "loading", "load_model": "loading", "open_weights": "weights",
    "load": "loading", "load_tokenizer": "loading",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ConfigError", "KTError", "RuleError", "WeightError", "build_model", "explain_plan", "format_explanation",
    "inject", "load", "load_config", "load_model", "load_tokenizer", "open_weights", "optimize_and_load_gguf",
    "plan_model",
]
