"""Mutated rule files end in the one-line ``file:line: ...`` RuleError (exit 2 from
``python -m ktransformers.optimize check``) or load; never another exception, never a hang."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ktransformers.errors import RuleError
from ktransformers.optimize import parse_rules
from ktransformers.optimize.__main__ import main as optimize_main

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RULES_DIR = Path(__file__).resolve().parents[2] / "ktransformers" / "optimize_rules"
SHIPPED = sorted(RULES_DIR.glob("*.yaml"))
ONE_LINE = re.compile(r"^[^\n]*:\d+: [^\n]+$|^[^\n]*: [^\n]+$")


def _ends_well(text: str, source: str = "m.yaml") -> str | None:
    """None when the rules load; the error when they do not. Any other exception fails the test."""
    try:
        parse_rules(text, source)
        return None
    except RuleError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(source), msg
        return msg


# ---- the mutations that used to end in a traceback or a hang ---------------------------------

ISSUE_CASES = [
    (b"# \xff comment\n- match: {name: x}\n  replace: {class: default}\n", ":1: not UTF-8 text: byte 0xff at column 3"),
    (b"- match: {name: x}\n  replace: !!python/object/apply:os.system ['true']\n", "tag '!!python/object/apply"),
    (b"- match: {name: x}\n  replace: {class: default}\n  ? [a, b]\n  : 1\n", "keys must be strings, not a list"),
    (b"- &r\n  match: {name: x}\n  replace: {class: default, kwargs: *r}\n", "recursive alias"),
    (b"- match: {name: x}\n  replace: {class: default, kwargs: {1: x}}\n", "(replace.kwargs): keys must be strings"),
    (b"- match: {name: x}\n  replace: {class: ..}\n", "rule #0 (replace.class)"),
    (b"- match: {name: " + b"[" * 1000 + b"]" * 1000 + b"}\n  replace: {}\n", "nested more than"),
    (b'- match: {name: "a{4294967296}"}\n  replace: {}\n', "(match.name): regular expression"),
    (b"- match: {name: x}\n  replace: {}\n  recursive: !!bool maybe\n", "(recursive): 'maybe' is not a valid !!bool"),
    (b"- a: &a [x,x,x,x,x,x,x,x,x,x]\n  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     b"  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n", "once aliases are expanded"),
    (b"- match: {name: x}\n  replace: [default]\n", "(replace) must be a mapping"),
]


@pytest.mark.parametrize("data, needle", ISSUE_CASES)
def test_issue_mutations_exit_2_with_one_line(tmp_path, capsys, data, needle):
    f = tmp_path / "bad.yaml"
    f.write_bytes(data)
    assert optimize_main(["check", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {f}:") and needle in err, err


# ---- class paths import only the project's, transformers' and torch's modules ---------------

_SIDE_EFFECT_OPERATOR = """
import pathlib, torch
pathlib.Path(__file__).with_name("imported.marker").write_text("the module's code ran")
class MyExperts(torch.nn.Module):
    pass
"""


@pytest.mark.parametrize("key, text, line", [
    ("match", "- match: {class: my_ops.experts.MyExperts}\n  replace: {class: default}\n", 1),
    ("replace", "- match: {name: x}\n  replace: {class: my_ops.experts.MyExperts}\n", 2),
])
def test_class_path_outside_the_allowed_packages_is_not_imported(tmp_path, monkeypatch, capsys, key, text, line):
    import sys

    for name in ("my_ops", "my_ops.experts"):  # each case imports its own copy
        monkeypatch.delitem(sys.modules, name, raising=False)
    pkg = tmp_path / "site" / "my_ops"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "experts.py").write_text(_SIDE_EFFECT_OPERATOR)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("KT_RULE_IMPORTS", raising=False)
    rule = tmp_path / "r.yaml"
    rule.write_text(text)
    assert optimize_main(["check", str(rule)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {rule}:{line}: rule #0 ({key}.class): module 'my_ops.experts' is outside the packages "
                   "rule files may import (ktransformers, transformers, torch); to load operators of your own, "
                   "set KT_RULE_IMPORTS=my_ops"), err
    assert not (pkg / "imported.marker").exists()  # refused before the import, not after

    monkeypatch.setenv("KT_RULE_IMPORTS", "other, my_ops")  # the documented opt-in
    rules = parse_rules(rule.read_text(), "r.yaml")
    assert (pkg / "imported.marker").exists()
    cls = rules[0].replace_class if key == "replace" else rules[0].match_class[0]
    assert cls.__name__ == "MyExperts" and cls.__module__ == "my_ops.experts"
    for name in ("my_ops", "my_ops.experts"):
        sys.modules.pop(name, None)


def test_shipped_rule_files_need_no_import_opt_in(monkeypatch):
    monkeypatch.delenv("KT_RULE_IMPORTS", raising=False)
    files = sorted(RULES_DIR.rglob("*.yaml"))  # the fine-tuning rules in sft/ too
    assert len(files) > len(SHIPPED)
    for f in files:
        assert _ends_well(f.read_text(), str(f)) is None, f


def test_transfer_map_keeps_integer_keys():
    rules = parse_rules("- match: {name: '^model$'}\n  replace:\n    class: KTransformersModel\n"
                        "    kwargs: {transfer_map: {2: cpu}}\n", "t.yaml")
    assert rules[0].kwargs["transfer_map"] == {2: "cpu"}


def test_catastrophic_pattern_ends_with_an_error_naming_the_rule():
    from ktransformers.optimize import safe_yaml

    rules = parse_rules("- match: {name: x}\n  replace: {}\n- match: {name: '^(.*?\\.){16}P'}\n  replace: {}\n",
                        "slow.yaml")
    name = "model.layers.10.mlp.experts.gate_proj." * 4  # backtracks over C(n, 16) ways to place the dots
    t0 = time.perf_counter()
    with pytest.raises(RuleError, match=r"slow.yaml:3: rule #1 \(match.name\): .* took more than"):
        rules[1].matches(name, None)
    assert time.perf_counter() - t0 < safe_yaml.MATCH_TIMEOUT_S + 2.0
    # the pattern the issue reported (nested repeats) no longer hangs on real module names
    slow = parse_rules("- match: {name: '^([\\\\w.]+)+x$'}\n  replace: {}\n", "r.yaml")[0]
    t0 = time.perf_counter()
    assert not slow.name_pattern.search("model.layers.0.self_attn.q_proj_and_some_more_letters")
    assert time.perf_counter() - t0 < 1.0


# ---- a fixed corpus: every shipped rule file, mutated each way ------------------------------

def _mutations(text: str) -> list[tuple[str, bytes]]:
    lines = text.splitlines(keepends=True)
    first_rule = next(i for i, ln in enumerate(lines) if ln.startswith("- "))
    mid = len(lines) // 2
    b = text.encode()
    out = [
        ("non-UTF-8 byte", b.replace(b"#", b"# \xfe", 1) if b"#" in b else b"\xfe" + b),
        ("python tag", text.replace("replace:", "replace: !!python/object/apply:os.system ['true']\n   x:", 1).encode()),
        ("custom tag", text.replace("match:", "match: !custom", 1).encode()),
        ("unhashable key", "".join(lines[:first_rule + 1] + ["  ? [a, b]\n  : 1\n"] + lines[first_rule + 1:]).encode()),
        ("recursive alias", text.replace("- match:", "- &top\n  match:", 1).replace("replace:", "kw: *top\n  replace:", 1)
         .encode()),
        ("integer kwarg name", text.replace("kwargs:", "kwargs:\n      1: x", 1).encode()),
        ("null key", text.replace("match:", "~: 1\n  match:", 1).encode()),
        ("dots class", re.sub(r"class: \S+", "class: ..", text, count=1).encode()),
        ("deep nesting", (text + "- match: {name: " + "[" * 100 + "]" * 100 + "}\n  replace: {}\n").encode()),
        ("huge repeat", re.sub(r'name: "[^"]*"', 'name: "a{4294967296}"', text, count=1).encode()),
        ("bad bool", text.replace("- match:", "- recursive: !!bool maybe\n  match:", 1).encode()),
        ("bad int", text.replace("- match:", "- recursive: !!int ten\n  match:", 1).encode()),
        ("bool as string", text.replace("- match:", "- recursive: 'false'\n  match:", 1).encode()),
        ("replace list", re.sub(r"replace:", "replace: [x]\n  was:", text, count=1).encode()),
        ("kwargs list", text.replace("kwargs:", "kwargs: [1, 2]\n    was:", 1).encode()),
        ("tab indent", text.replace("  replace:", "\treplace:", 1).encode()),
        ("truncated", b[: len(b) // 2]),
        ("truncated early", b[: len(b) // 7]),
        ("line dropped", "".join(lines[:mid] + lines[mid + 1:]).encode()),
        ("line doubled", "".join(lines[:mid + 1] + lines[mid:]).encode()),
        ("unclosed flow", text.replace("{", "{[", 1).encode()),
        ("unclosed quote", text.replace('"', "", 1).encode()),
        ("empty", b""),
        ("a scalar", b"just text\n"),
        ("a mapping", b"match: {name: x}\nreplace: {}\n"),
        ("billion laughs", b"- l0: &a [x,x,x,x,x,x,x,x,x,x]\n" + b"".join(
            f"  l{i}: &{chr(97 + i)} [{','.join(['*' + chr(96 + i)] * 10)}]\n".encode() for i in range(1, 7))),
        ("NUL byte", b.replace(b"\n", b"\x00\n", 1)),
        ("BOM + CRLF", b"\xef\xbb\xbf" + b.replace(b"\n", b"\r\n")),
    ]
    return out


CORPUS = [(p.name, kind, data) for p in SHIPPED for kind, data in _mutations(p.read_text())]


def test_every_shipped_rule_file_mutated_each_way_ends_in_a_named_error_or_loads():
    assert len(SHIPPED) >= 20 and len(CORPUS) >= 500
    outcomes = {"error": 0, "loaded": 0}
    for name, kind, data in CORPUS:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the file path is checked below through read_text
        outcomes["loaded" if _ends_well(text, name) is None else "error"] += 1
    assert outcomes["error"] > outcomes["loaded"] > 0, outcomes


def test_undecodable_mutations_through_the_file_path(tmp_path):
    from ktransformers.optimize import load_rules

    n = 0
    for name, kind, data in CORPUS:
        if kind not in ("non-UTF-8 byte", "NUL byte", "BOM + CRLF"):
            continue
        f = tmp_path / name
        f.write_bytes(data)
        try:
            load_rules(f)
        except RuleError as e:
            assert "\n" not in str(e) and str(e).startswith(str(f))
        n += 1
    assert n == 3 * len(SHIPPED)


# ---- property-based: random edits of a real rule file ---------------------------------------

SEED_TEXT = (RULES_DIR / "Qwen3Moe-cpu.yaml").read_text()
YAML_BITS = ["[", "]", "{", "}", ":", "- ", "&a ", "*a", "!!", "!!python/name:os.system ", "? ", "'", '"', "\n",
             "\t", "#", "|", ">", "<<: ", "1: ", "~", "!!bool ", "!!int ", "%YAML 1.1\n", "---\n", "...\n", "\\",
             "{{", "a{99999999999}", "(?P<", "\ud800", "\x00", "\x85", "\u2028"]


@st.composite
def edited_rule_files(draw):
    text = SEED_TEXT
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(st.one_of(st.sampled_from(YAML_BITS), st.text(max_size=8)))
        if op == "insert":
            text = text[:pos] + piece + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 40)):]
        else:
            text = text[:pos] + piece + text[pos + len(piece):]
    return text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(edited_rule_files())
def test_fuzz_rule_loader_named_error_or_success(text):
    _ends_well(text)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.binary(max_size=400))
def test_fuzz_rule_file_bytes(tmp_path_factory, data):
    from ktransformers.optimize import load_rules

    f = tmp_path_factory.mktemp("fz") / "f.yaml"
    f.write_bytes(data)
    try:
        load_rules(f)
    except RuleError as e:
        assert "\n" not in str(e) and str(e).startswith(str(f))
