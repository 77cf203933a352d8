"""The load pipeline: weights and config, rules and plan, tokenizer, injection and weights
(``pipeline.py``), the tokenizer of a load (``tokenizer.py``).  ``load_model``, ``load``,
``local_chat``, the server and fine-tuning all load through :func:`pipeline.load_for_generation`'s
steps."""

from .pipeline import (LoadedModel, check_memory_plan, inject, load, load_config, load_draft_model,
                       load_for_generation, load_model)
from .tokenizer import load_tokenizer

__all__ = [
    "LoadedModel", "check_memory_plan", "inject", "load", "load_config", "load_draft_model", "load_for_generation",
    "load_model", "load_tokenizer",
]
