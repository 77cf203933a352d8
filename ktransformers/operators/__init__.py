"""Injected operators.  Registration and name resolution: ``registry.py``; the reference
system's names: ``compat.py``; module kinds: ``kinds.py``; per-phase decisions: ``phases.py``."""

from __future__ import annotations

from .base import BaseInjectedModule, Op
from .registry import operators, register

__all__ = ["BaseInjectedModule", "Op", "operators", "register"]
