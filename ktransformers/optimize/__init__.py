"""Rule engine: parse/validate rule files, plan placements, inject operators, explain."""

from .explain import Explanation, explain_plan, format_explanation
from .inject import build_model, inject, optimize_and_load_gguf
from .plan import Plan, Placement, plan_model
from .rules import Rule, load_rules, parse_rules

__all__ = [
    "Explanation", "Placement", "Plan", "Rule", "build_model", "explain_plan", "format_explanation", "inject",
    "load_rules", "optimize_and_load_gguf", "parse_rules", "plan_model",
]
