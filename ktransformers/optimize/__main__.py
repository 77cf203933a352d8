"""``python -m ktransformers.optimize check RULES.yaml`` / ``explain RULES.yaml --model_path DIR``.

Exit codes: 0 ok, 2 invalid input (one line on stderr naming file, line, rule and key).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import KTError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktransformers.optimize", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a rule file without a model")
    c.add_argument("rules")
    e = sub.add_parser("explain", help="show what each rule matches and where every weight goes")
    e.add_argument("rules")
    e.add_argument("--model_path", help="folder with config.json (optional when --gguf_path has metadata)")
    e.add_argument("--gguf_path", help="weights (GGUF or safetensors); counts stored bytes, config from metadata")
    e.add_argument("--device", default="cpu", help="device of modules no rule places (default cpu)")
    e.add_argument("--device_map", metavar="FROM=TO[,...]",
                   help="rewrite the devices the rules name, e.g. cuda=cpu (a GPU rule file on a CPU-only machine)")
    e.add_argument("--allow-unmatched", action="store_true", help="do not fail on rules that match nothing")
    e.add_argument("--compact", action="store_true", help="fold rows that differ only in layer numbers")
    e.add_argument("--context", type=int, metavar="TOKENS",
                   help="size the KV cache in the memory plan at this many tokens and count it in the peak "
                        "[the model's max positions, reported only]")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            from .rules import load_rules

            from .explain import alias_lines

            rules = load_rules(args.rules)
            print(f"{args.rules}: {len(rules)} rule(s), all valid")
            for line in alias_lines(rules):
                print(f"  {line}")
            return 0
        return _explain(args)
    except KTError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _explain(args) -> int:
    """The plan of a load (``loading.plan_load``, the one every load makes), made to be read: no weight
    is read and the devices need not be this machine's, so a GPU rule file explains on a CPU-only one."""
    from ..loading.pipeline import plan_load
    from .explain import explain_plan, format_explanation

    planned = plan_load(args.gguf_path, args.model_path, args.rules, device=args.device,
                        device_map=args.device_map, allow_unmatched=True, plan_only=True)
    model, plan = planned.model, planned.plan
    ex = explain_plan(model, plan, planned.source, context=args.context)
    print(format_explanation(ex, compact=args.compact))
    if ex.unmatched and not args.allow_unmatched:
        bad = [plan.rules[i] for i in ex.unmatched]
        for r in bad:
            print(f"error: {r.where()}: matches no module of {type(model).__name__} ({r.describe_match()})",
                  file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
