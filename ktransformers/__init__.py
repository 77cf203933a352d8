"""ktransformers: run huge Mixture-of-Experts models on one machine.

Build the unmodified transformers model on the meta device, let a YAML rule file say which
operator (and device, per phase) each module gets, then stream the weights in::

    from ktransformers import build_model, inject
    model = inject(build_model(config), "rules.yaml", "model.gguf")
    model.generate(...)

or in one call: ``load_model(weights_path, model_path=None, rules=None)``.
"""

__version__ = "0.1.0"

from .errors import ConfigError, KTError, RuleError, WeightError
from .optimize import build_model, explain_plan, format_explanation, inject, optimize_and_load_gguf, plan_model
from .util.loading import load_config, load_model
from .weights import open_weights

__all__ = [
    "ConfigError", "KTError", "RuleError", "WeightError", "build_model", "explain_plan", "format_explanation",
    "inject", "load_config", "load_model", "open_weights", "optimize_and_load_gguf", "plan_model",
]
