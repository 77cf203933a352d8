"""Mutated rule files end in the one-line ``file:line: ...`` RuleError (exit 2 from
``python -m ktransformers.optimize check``) or load; never another exception, never a hang."""

from __future__ import annotations

import contextlib
import faulthandler
import re
import sys
import time
from pathlib import Path

import pytest

from ktransformers.errors import RuleError
from ktransformers.optimize import parse_rules
from ktransformers.optimize.__main__ import main as optimize_main

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

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
    assert err == (f"error: {rule}:{line}: rule #0 ({key}.class): module 'my_ops.experts' is outside what rule "
                   "files may name (torch.nn, transformers.models.*.modeling_*, ktransformers operators); to load "
                   "operators of your own, set KT_RULE_IMPORTS=my_ops"), err
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


@fuzz_settings(200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(edited_rule_files())
def test_fuzz_rule_loader_named_error_or_success(text):
    _ends_well(text)


@fuzz_settings(150, deadline=None, derandomize=True)
@given(st.binary(max_size=400))
def test_fuzz_rule_file_bytes(tmp_path_factory, data):
    from ktransformers.optimize import load_rules

    f = tmp_path_factory.mktemp("fz") / "f.yaml"
    f.write_bytes(data)
    try:
        load_rules(f)
    except RuleError as e:
        assert "\n" not in str(e) and str(e).startswith(str(f))


# ---- bad input that loaded, hung or ended in a traceback (second round) ---------------------

NEW_CASES = [
    (b'- match: {name: "a{2147483648}"}\n  replace: {}\n', ":1: rule #0 (match.name): regular expression "
                                                        "'a{2147483648}' repeats 2147483648 times"),
    (b'- match: {name: "(?:(?:a{100}){100}){100}"}\n  replace: {}\n', "nested repetitions that expand"),
    (b'- match: {name: "' + b"x" * 1001 + b'"}\n  replace: {}\n', "is 1001 characters long"),
    (b'- match: {name: x}\n  replace: {class: "\\UFFFFFFFF"}\n', ":2: not valid YAML: a character escape"),
    (b'- match: {name: "\\U00110000"}\n  replace: {}\n', ":1: not valid YAML: a character escape"),
    (b"- match: {class: torch." + b"a." * 2000 + b"b}\n  replace: {}\n", "(match.class): class path 'torch.a.a"),
    (b"- match: {name: x}\n  replace: {class: ktransformers.server.__main__.X}\n", "goes through a __main__ module"),
    (b"- match: {class: torch.utils.model_dump.__main__.X}\n  replace: {}\n", "goes through a __main__ module"),
    (b"- match: {class: torch.utils.model_dump.X}\n  replace: {}\n", "module 'torch.utils.model_dump' is outside"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: ''}\n",
     "(replace.kwargs): must be a mapping (key: value), not an empty string"),
    (b"- match: {name: x}\n  replace:\n    class: KTransformersLinear\n    kwargs:\n      generate_op: KLinearTorch\n"
     b"      generate_op: KLinearCPU\n", ":6: rule #0 (replace.kwargs): key 'generate_op' given twice (first on line 5)"),
    (b"- match: {name: x}\n  match: {name: y}\n  replace: {}\n", ":2: rule #0 (rule): key 'match' given twice"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {prefill_threshold: true}}\n",
     "(replace.kwargs.prefill_threshold): must be int, not True"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {prefill_threshold: -5}}\n",
     "(replace.kwargs.prefill_threshold): -5 is out of range"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {prefill_threshold: 1" + b"0" * 30 + b"}}\n",
     "(replace.kwargs.prefill_threshold): 1000000000000000000000000000000 is out of range"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {prefill_threshold: 1:30}}\n",
     "'1:30' reads as a base-60 number in YAML 1.1 (1:30 = 90)"),
    (b"- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {generate_op: ''}}\n",
     "(replace.kwargs.generate_op): the value is an empty string"),
    (b"- match: {name: x}\n  replace: {class: torch.nn.Module}\n", "'torch.nn.Module' is the base class of every module"),
    (b"- match: {name: x}\n  replace: {class: transformers.models.llama.modeling_llama.LlamaForCausalLM}\n",
     "LlamaForCausalLM' is a whole model, not an operator"),
    (b"- match: {name: x}\n  replace: {class: torch.nn.Linear}\n", "'torch.nn.Linear' is not an operator"),
    (b"- match: {name: '^model$'}\n  replace: {class: KTransformersModel, kwargs: {transfer_map: {1: mps}}}\n",
     "(replace.kwargs.transfer_map): layer 1: 'mps' is not a device rules can place modules on"),
    (b'- match: {class: "a\\nb"}\n  replace: {}\n', "(match.class): 'a\\nb' is not a class path"),
    (b'- match: {name: x, "a\\nb": 1}\n  replace: {}\n', "(match.a\\nb): unknown key"),
    (b'- match: {name: x}\n  replace: {class: KTransformersLinear, kwargs: {generate_op: "a\\nb"}}\n',
     "has no op 'a\\nb'"),
    (b"[]\n", ":1: the rule file has no rules"),
    (b"# nothing yet\n--- []\n", ":2: the rule file has no rules"),
] + [(f"- match: {{name: x}}\n  replace: {{class: default, device: {d}}}\n".encode(),
      f"(replace.device): '{d}' is not a device rules can place modules on")
     for d in ("meta", "mps", "xla", "lazy", "hpu", "privateuseone", "xpu:1")]


@pytest.mark.parametrize("data, needle", NEW_CASES)
def test_second_round_reproductions_exit_2_with_one_line(tmp_path, capsys, data, needle):
    f = tmp_path / "bad.yaml"
    f.write_bytes(data)
    with _no_hang():
        assert optimize_main(["check", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {f}:") and needle in err, err


def test_class_paths_run_no_program_and_no_module_outside_the_namespaces(tmp_path, monkeypatch):
    for mod in ("ktransformers.server.__main__", "torch.utils.model_dump", "torch.utils.model_dump.__main__"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    for text in ("ktransformers.server.__main__.X", "torch.utils.model_dump.__main__.X", "torch.utils.model_dump.X",
                 "ktransformers.server.main.X", "os.path.X"):
        for key in ("match", "replace"):
            rule = (f"- match: {{class: {text}}}\n  replace: {{}}\n" if key == "match"
                    else f"- match: {{name: x}}\n  replace: {{class: {text}}}\n")
            msg = _ends_well(rule)
            assert msg is not None and f"({key}.class)" in msg, (text, key, msg)
    assert "ktransformers.server.__main__" not in sys.modules
    assert "torch.utils.model_dump" not in sys.modules
    # a user's package named in KT_RULE_IMPORTS: its modules, never its __main__
    pkg = tmp_path / "site" / "my_prog"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').write_text('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KT_RULE_IMPORTS", "my_prog")
    assert "__main__ module" in _ends_well("- match: {name: x}\n  replace: {class: my_prog.__main__.X}\n")
    assert not (pkg / "ran").exists()
    sys.modules.pop("my_prog", None)


def test_the_namespaces_rules_name_still_resolve():
    from torch import nn
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    rules = parse_rules(
        "- match: {class: torch.nn.modules.linear.Linear}\n  replace: {class: KTransformersLinear}\n"
        "- match: {class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts}\n"
        "  replace: {class: ktransformers.sft.torch_experts.KSFTExpertsTorch}\n"
        "- match: {class: ktransformers.operators.linear.KTransformersLinear}\n  replace: {class: default}\n"
        "- match: {name: '^lm_head$'}\n  replace:\n    class: ktransformers.operators.linear.KTransformersLinear\n"
        "    kwargs:\n", "ok.yaml")
    assert rules[0].match_class == (nn.Linear,)
    assert rules[1].match_class == (modeling_qwen3_moe.Qwen3MoeExperts,)
    assert rules[1].replace_class.__name__ == "KSFTExpertsTorch"
    assert rules[2].match_class[0].__name__ == "KTransformersLinear"
    assert rules[3].kwargs == {}  # ``kwargs:`` with nothing after it: none
    # a path that names a registered leaf through the wrong module says where it is
    msg = _ends_well("- match: {name: x}\n  replace: {class: ktransformers.server.KTransformersLinear}\n")
    assert "did you mean 'ktransformers.operators.linear.KTransformersLinear'" in msg, msg
    # quoted, a base-60 look-alike is the text it looks like
    assert parse_rules("- match: {name: '1:30'}\n  replace: {}\n", "q.yaml")[0].name_pattern.pattern == "1:30"


def test_device_map_reads_the_file_through_the_same_checks(tmp_path):
    from ktransformers.errors import ConfigError
    from ktransformers.optimize.device_map import load_rules_mapped, parse_device_map

    f = tmp_path / "gpu.yaml"
    f.write_bytes(b'- match: {name: "\\UFFFFFFFF"}\n  replace: {class: default, device: cuda}\n')
    with pytest.raises(RuleError, match=rf"^{re.escape(str(f))}:1: not valid YAML: a character escape"):
        load_rules_mapped(f, "cuda=cpu")
    f.write_bytes(b"- match: {name: x}\n  replace: {class: default, device: cuda}\n" + b"#\xff\n")
    with pytest.raises(RuleError, match=r":3: not UTF-8 text"):
        load_rules_mapped(f, "cuda=cpu")
    deep = "- match: {name: " + "[" * 2000 + "]" * 2000 + "}\n  replace: {class: default, device: cuda}\n"
    with pytest.raises(RuleError, match="nested more than"):
        load_rules_mapped(deep, "cuda=cpu")
    with pytest.raises(ConfigError, match=r"--device_map 'cuda=meta': rules cannot place modules on 'meta'"):
        parse_device_map("cuda=meta")


# ---- property-based: each class of bad input, generated ---------------------------------------

HARD_LIMIT_S = 60
EXAMPLE_LIMIT_S = 5.0


@contextlib.contextmanager
def _no_hang():
    """A hang past ``HARD_LIMIT_S`` ends the run with every thread's traceback instead of stalling it
    (a compiler stuck in C code never returns to a Python-level timeout)."""
    faulthandler.dump_traceback_later(HARD_LIMIT_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _ends_in_time(text: str, source: str = "m.yaml") -> str | None:
    t0 = time.perf_counter()
    try:
        with _no_hang():
            return _ends_well(text, source)
    finally:
        assert time.perf_counter() - t0 < EXAMPLE_LIMIT_S, text[:200]


def _rule(match: str = "{name: x}", replace: str = "{class: KTransformersLinear}") -> str:
    return f"- match: {match}\n  replace: {replace}\n"


_ATOMS = st.sampled_from(["a", ".", "\\d", "[a-z]", "\\.", "(?:x|y)", "(", ")", "(?:", "{", "}", ",", "*", "+", "?"])


@st.composite
def repeat_heavy_patterns(draw):
    """Patterns with counted repeats, nested or not, small to absurd (``a{2147483648}``)."""
    out = ""
    for _ in range(draw(st.integers(1, 8))):
        out += draw(_ATOMS)
        if draw(st.booleans()):
            n = draw(st.one_of(st.integers(0, 2000), st.integers(2**31 - 2, 2**32 + 2), st.integers(0, 10**40)))
            out += draw(st.sampled_from(["{%d}", "{%d,}", "{,%d}", "{1,%d}", "{e<=%d}"])) % n
        if draw(st.integers(0, 3)) == 0:
            out = f"(?:{out})"
    return out


@fuzz_settings(150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(repeat_heavy_patterns())
def test_fuzz_match_name_repeats_end_in_time(pattern):
    _ends_in_time(_rule(match="{name: %s}" % _yaml_quote(pattern)))


def _yaml_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_ESCAPE_PLACES = [
    '- match: {{name: "{e}"}}\n  replace: {{}}\n', '- match: {{class: "{e}"}}\n  replace: {{}}\n',
    '- match: {{name: x}}\n  replace: {{class: "{e}"}}\n', '- match: {{name: x}}\n  replace: {{device: "{e}"}}\n',
    '- match: {{name: x}}\n  replace: {{class: KTransformersLinear, kwargs: {{generate_op: "{e}"}}}}\n',
    '- match: {{name: x}}\n  replace: {{class: KTransformersLinear, kwargs: {{"{e}": 1}}}}\n',
    '- match: {{name: x, "{e}": 1}}\n  replace: {{}}\n', '- "{e}": 1\n  match: {{name: x}}\n  replace: {{}}\n',
]


@fuzz_settings(200, deadline=None, derandomize=True)
@given(st.sampled_from(["\\U", "\\u", "\\x"]), st.one_of(st.integers(0, 0x9F), st.integers(0, 2**32 - 1)),
       st.sampled_from(_ESCAPE_PLACES))
def test_fuzz_character_escapes_end_in_a_named_error_or_load(kind, code, place):
    """Escapes past U+10FFFF, and the control characters (a newline too) escapes make, in every
    place of a rule: a one-line error or a load."""
    width = {"\\U": 8, "\\u": 4, "\\x": 2}[kind]
    escape = f"{kind}{code % 16 ** width:0{width}X}"
    _ends_in_time("- match: {name: x}\n  replace: {}\n" + place.format(e=escape))


_PART = st.text(alphabet="ab_", min_size=1, max_size=6).filter(str.isidentifier)
_PREFIXES = ["torch", "torch.nn", "torch.utils", "transformers", "transformers.models", "ktransformers",
             "ktransformers.server", "ktransformers.operators", "ktransformers.models", "os", "subprocess", "my_ops"]


@st.composite
def class_paths(draw):
    parts = [draw(st.sampled_from(_PREFIXES))]
    n = draw(st.one_of(st.integers(0, 6), st.integers(10, 3000)))
    parts += [draw(_PART)] * n if n > 50 else [draw(st.one_of(_PART, st.just("__main__"))) for _ in range(n)]
    parts.append(draw(st.sampled_from(["X", "Linear", "Module", "KTransformersLinear", "LlamaForCausalLM"])))
    return ".".join(parts)


@fuzz_settings(150, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # the env, once
@given(class_paths(), st.sampled_from(["match", "replace"]))
def test_fuzz_class_paths_import_nothing_outside_the_namespaces(monkeypatch_env, path, key):
    from ktransformers.operators.registry import load_all

    load_all()  # the project's own operator modules register once, whatever the path
    before = set(sys.modules)
    text = _rule(match=f"{{class: {path}}}", replace="{}") if key == "match" else _rule(replace=f"{{class: {path}}}")
    msg = _ends_in_time(text)
    assert set(sys.modules) == before, sorted(set(sys.modules) - before)
    registered = path.startswith("ktransformers.operators.") and path.endswith(".KTransformersLinear")
    if key == "replace" and not registered:  # none of the others names an operator
        assert msg is not None and "(replace.class)" in msg, (path, msg)


@pytest.fixture
def monkeypatch_env():
    import os

    saved = os.environ.pop("KT_RULE_IMPORTS", None)
    yield
    if saved is not None:
        os.environ["KT_RULE_IMPORTS"] = saved


_BAD_THRESHOLDS = st.one_of(st.booleans(), st.integers(max_value=-1), st.integers(min_value=2**31),
                            st.builds(lambda h, m: f"{h}:{m:02d}", st.integers(0, 99), st.integers(0, 59)))
_BAD_DEVICE_TYPES = ["meta", "mps", "xla", "lazy", "hpu", "privateuseone", "xpu", "ipu", "mtia", "vulkan", "fpga"]


_FAMILIES = ("llama", "qwen3_moe", "mixtral", "gemma3")


@st.composite
def accepted_but_wrong(draw):
    """Rule files YAML reads fine whose values cannot be meant."""
    kind = draw(st.sampled_from(["threshold", "empty op", "kwargs scalar", "device", "kwarg device", "empty file",
                                 "duplicate key", "not an operator"]))
    if kind == "not an operator":
        family = draw(st.sampled_from(_FAMILIES))
        module = f"transformers.models.{family}.modeling_{family}"
        name = {"llama": "Llama", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "gemma3": "Gemma3"}[family]
        cls = draw(st.sampled_from(["torch.nn.Module", "torch.nn.modules.module.Module", "torch.nn.Linear",
                                    f"{module}.{name}ForCausalLM", f"{module}.{name}Model",
                                    f"{module}.{name}PreTrainedModel"]))
        return _rule(replace=f"{{class: {cls}}}")
    if kind == "threshold":
        v = draw(_BAD_THRESHOLDS)
        return _rule(replace=f"{{class: KTransformersLinear, kwargs: {{prefill_threshold: {str(v).lower()}}}}}")
    if kind == "empty op":
        key = draw(st.sampled_from(["generate_op", "prefill_op", "backend", "generate_device"]))
        return _rule(replace=f"{{class: KTransformersExperts, kwargs: {{{key}: ''}}}}")
    if kind == "kwargs scalar":
        v = draw(st.sampled_from(["''", "0", "1", "true", "false", "x", "'{}'", "[]", "[a]"]))
        return _rule(replace=f"{{class: KTransformersLinear, kwargs: {v}}}")
    if kind in ("device", "kwarg device"):
        dev = draw(st.sampled_from(_BAD_DEVICE_TYPES)) + draw(st.sampled_from(["", ":0", ":1"]))
        if kind == "device":
            return _rule(replace=f"{{class: default, device: '{dev}'}}")
        key = draw(st.sampled_from(["generate_device", "prefill_device", "out_device"]))
        return _rule(replace=f"{{class: KTransformersLinear, kwargs: {{{key}: '{dev}'}}}}")
    if kind == "empty file":
        return draw(st.sampled_from(["[]", "[ ]", "--- []", "# rules\n[]", "[]\n...\n", "!!seq []"])) + "\n"
    # a key twice in one of the rule's mappings, at any place
    where = draw(st.sampled_from(["rule", "match", "replace", "kwargs"]))
    kw = ["generate_op: KLinearTorch", "prefill_threshold: 3", "generate_device: cpu"]
    maps = {"rule": ["match: {name: x}", "replace: {class: KTransformersLinear}", "recursive: true"],
            "match": ["name: x", "class: torch.nn.Linear"], "replace": ["class: KTransformersLinear", "device: cpu"],
            "kwargs": kw}
    items = maps[where]
    dup = draw(st.sampled_from(items))
    items = items[:]
    items.insert(draw(st.integers(0, len(items))), dup)
    body = {"rule": None, "match": "{name: x}", "replace": "{class: KTransformersLinear}", "kwargs": None}
    if where == "rule":
        return "- " + "\n  ".join(items) + "\n"
    if where == "kwargs":
        return _rule(replace="{class: KTransformersLinear, kwargs: {" + ", ".join(items) + "}}")
    body[where] = "{" + ", ".join(items) + "}"
    return _rule(match=body["match"], replace=body["replace"])


@fuzz_settings(200, deadline=None, derandomize=True)
@given(accepted_but_wrong())
def test_fuzz_accepted_but_wrong_values_are_refused(text):
    import importlib

    for family in _FAMILIES:  # imported once, outside the time bound (a first import is slow on a busy machine)
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert _ends_in_time(text) is not None, text


_DEVICES = ["cpu", "cuda", "cuda:0", "cuda:1"] * 4 + ["cudaa", ""]  # mostly devices, some refused as written
_DEVICE_PLACES = ["replace.device", "device", "generate_device", "prefill_device", "out_device"]


@st.composite
def mapped_rules(draw):
    """(rule text with one device per place, the device map) for an operator with ops and its op choice,
    ``default``, or the model operator with a ``transfer_map``."""
    cls = draw(st.sampled_from(["KTransformersLinear", "KTransformersExperts", "default", "KTransformersModel"]))
    places = {p: draw(st.sampled_from(_DEVICES)) for p in draw(st.lists(st.sampled_from(_DEVICE_PLACES), min_size=1,
                                                                       max_size=3, unique=True))}
    kwargs = {p: d for p, d in places.items() if p != "replace.device"}
    if cls == "KTransformersLinear" and draw(st.integers(0, 3)):
        kwargs["generate_op"] = draw(st.sampled_from(["KLinearCPU", "KLinearTorch"]))
    if cls == "KTransformersExperts" and draw(st.integers(0, 3)):
        kwargs["generate_op"] = draw(st.sampled_from(["KExpertsCPU", "KExpertsTorch"]))
    if cls == "KTransformersModel" and draw(st.booleans()):
        kwargs["transfer_map"] = {draw(st.integers(0, 3)): draw(st.sampled_from(_DEVICES))}
    dmap = draw(st.dictionaries(st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:1"]),
                                st.sampled_from(["cpu", "cuda:0", "cuda:1"]), min_size=1, max_size=3))
    return cls, places.get("replace.device"), kwargs, dmap


def _rule_text(cls, device, kwargs) -> str:
    import json

    replace = {"class": cls}
    if device is not None:
        replace["device"] = device
    if kwargs:
        replace["kwargs"] = kwargs
    return "- match: {name: '^lm_head$'}\n  replace: " + json.dumps(replace) + "\n"  # JSON is YAML


@fuzz_settings(200, deadline=None, derandomize=True)
@given(mapped_rules())
def test_fuzz_device_map_on_parsed_rules_is_the_file_written_mapped(case):
    """A device map on the parsed rules gives what the file written with the mapped devices gives: the
    same rules, or the same one-line error -- except that a file invalid as written stays refused."""
    from ktransformers.optimize.device_map import load_rules_mapped, map_device

    cls, device, kwargs, dmap = case
    mapped_kwargs = {k: (map_device(v, dmap) if k != "transfer_map" else {n: map_device(d, dmap) for n, d in v.items()})
                     for k, v in kwargs.items()}
    written = _rule_text(cls, map_device(device, dmap), mapped_kwargs)
    original = _rule_text(cls, device, kwargs)
    as_written = _ends_well(written, "r.yaml")
    if _ends_well(original, "r.yaml") is not None:
        return  # refused before any map (the parser's own fuzz tests cover these)
    try:
        got = load_rules_mapped(original, dmap)
    except RuleError as e:
        msg = str(e).replace("<string>", "r.yaml")
        assert msg == as_written, (original, dmap)
        return
    assert as_written is None, (original, dmap, as_written)
    (want,) = parse_rules(written, "<string>")
    (rule,) = got
    assert (rule.device, rule.kwargs, rule.key_lines, rule.line) == (want.device, want.kwargs, want.key_lines, want.line)
