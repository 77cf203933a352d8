"""Reference-system module path ``ktransformers.optimize.optimize`` (kept for existing scripts)."""

from .inject import inject, optimize_and_load_gguf

__all__ = ["inject", "optimize_and_load_gguf"]
