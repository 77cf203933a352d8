"""The load pipeline: weights and config, rules and plan, tokenizer, injection and weights
(``pipeline.py``: :func:`plan_load` then :func:`load_planned`, which every load goes through), the
tokenizer of a load (``tokenizer.py``).  ``load_model``, ``load``, ``local_chat``, the server and
fine-tuning all load through them."""

from .pipeline import (LoadedModel, PlannedLoad, check_memory_plan, inject, load, load_config, load_draft_model,
                       load_for_generation, load_model, load_planned, plan_load)
from .tokenizer import load_tokenizer

__all__ = [
    "LoadedModel", "PlannedLoad", "check_memory_plan", "inject", "load", "load_config", "load_draft_model",
    "load_for_generation", "load_model", "load_planned", "load_tokenizer", "plan_load",
]
