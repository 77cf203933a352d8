"""``python -m ktransformers.local_chat``: one-shot runs, error handling, the interactive loop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READY_RE = re.compile(r"ready in ([\d.]+) s: start-up ([\d.]+) s \(torch, transformers, CPU kernels\), "
                      r"header and plan ([\d.]+) s, tokenizer ([\d.]+) s, weights ([\d.]+) s")
STATS_RE = re.compile(r"prompt eval count: (\d+) token\(s\), duration: [\d.]+s, rate: [\d.]+ tokens/s \| "
                      r"eval count: (\d+) token\(s\), duration: [\d.]+s, rate: [\d.]+ tokens/s")


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_chat(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "ktransformers.local_chat", *map(str, args)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


# --------------------------------------------------------------------------------- one shot


def test_one_shot_prompt_prints_answer_and_stats(tiny_model_dir):
    d = tiny_model_dir("llama")
    r = run_chat("--model_path", d, "--prompt", "Hello", "--max_new_tokens", 12, "--stats", "--cpu_infer", 1)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and len(r.stdout) >= 12  # 12 byte tokens of text + newline
    m = STATS_RE.search(r.stderr)
    assert m, r.stderr
    assert int(m.group(2)) == 12 and int(m.group(1)) > 5
    assert READY_RE.search(r.stderr) and "Dense-cpu.yaml" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_ready_line_adds_up_the_phases(tiny_model_dir):
    """The start-up line says where the time went, and its phases add up to the total."""
    d = tiny_model_dir("llama")
    r = run_chat("--model_path", d, "--prompt", "Hi", "--max_new_tokens", 2, "--cpu_infer", 1)
    assert r.returncode == 0, r.stderr
    m = READY_RE.search(r.stderr)
    assert m, r.stderr
    total, parts = float(m.group(1)), [float(x) for x in m.group(2, 3, 4, 5)]
    assert abs(sum(parts) - total) <= 0.25, r.stderr  # each printed to 0.1 s


def test_one_token_answer_prints_no_rate_and_is_marked_cut(tiny_model_dir):
    d = tiny_model_dir("llama")
    r = run_chat("--model_path", d, "--prompt", "Hi", "--max_new_tokens", 1, "--stats", "--cpu_infer", 1)
    assert r.returncode == 0, r.stderr
    assert "eval count: 1 token(s)" in r.stderr and "0.00 tokens/s" not in r.stderr, r.stderr
    assert "rate: - (too few tokens to time)" in r.stderr
    assert "[cut: the answer reached --max_new_tokens (1 token)]" in r.stderr
    assert "[cut" not in r.stdout  # stdout holds the answer alone


def test_one_shot_without_stats_flag_prints_no_stats(tiny_model_dir):
    d = tiny_model_dir("llama")
    r = run_chat("--gguf_path", d, "--model_path", d, "--prompt", "Hi", "--max_new_tokens", 3,
                 "--force_think", "--temperature", 0.8, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("<think>\n")
    assert not STATS_RE.search(r.stderr)


# ----------------------------------------------------------------------------------- errors


def test_missing_path_is_one_line(tmp_path):
    line = _one_error_line(run_chat("--gguf_path", tmp_path / "nope.gguf", "--prompt", "x"))
    assert "nope.gguf" in line


def test_bad_flag_is_one_line():
    _one_error_line(run_chat("--no_such_flag", "1"))
    _one_error_line(run_chat("--mode", "turbo"))


def test_no_weights_is_one_line():
    _one_error_line(run_chat("--prompt", "x"))


def test_rule_file_for_another_architecture(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    rules = ROOT / "ktransformers" / "optimize_rules" / "DeepSeek-V3-Chat-cpu.yaml"
    line = _one_error_line(run_chat("--model_path", d, "--optimize_config_path", rules, "--prompt", "x"))
    assert "matches no module" in line and "DeepSeek-V3-Chat-cpu.yaml" in line


def test_long_context_only_for_llama(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    line = _one_error_line(run_chat("--model_path", d, "--mode", "long_context", "--prompt", "x"))
    assert "long_context" in line and "Qwen3MoeForCausalLM" in line


def test_long_context_runs_for_llama(tiny_model_dir):
    d = tiny_model_dir("llama")
    r = run_chat("--model_path", d, "--mode", "long_context", "--prompt", "x", "--max_new_tokens", 4)
    assert r.returncode == 0, r.stderr


def test_gguf_without_tokenizer_needs_model_path(fixtures_dir):
    gguf = fixtures_dir / "qwen3moe-tiny" / "Q8_0.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not present")
    line = _one_error_line(run_chat("--gguf_path", gguf, "--prompt", "x"))
    assert "tokenizer" in line and "--model_path" in line


def test_help_documents_every_flag():
    r = run_chat("--help")
    assert r.returncode == 0
    for flag in ("--model_path", "--gguf_path", "--optimize_config_path", "--max_new_tokens", "--cpu_infer",
                 "--use_cuda_graph", "--prompt_file", "--mode", "--force_think", "--chunk_size", "--device",
                 "--prompt", "--temperature", "--top_p", "--top_k", "--seed", "--stats"):
        assert flag in r.stdout


# ------------------------------------------------------------------------------ interactive


def _spawn(*args, timeout=120):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "ktransformers.local_chat", *map(str, args)], cwd=str(ROOT),
                          env=_env(), encoding="utf-8", timeout=timeout, dimensions=(50, 400))
    return pexpect, child


@contextmanager
def chat_session(*args):
    """local_chat started with ``args``, at its first ``Chat: ``; leaving the block ends its input,
    and it must exit with status 0."""
    pexpect, child = _spawn(*args)
    try:
        child.expect_exact("Chat: ")
        yield child
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_interactive_two_turns_and_multiline_block(tiny_model_dir, tmp_path):
    d = tiny_model_dir("llama")
    pf = tmp_path / "prompt.txt"
    pf.write_text("text from the prompt file")
    pexpect, child = _spawn("--model_path", d, "--max_new_tokens", 8, "--cpu_infer", 1, "--prompt_file", pf)
    try:
        child.expect_exact("Chat: ")
        counts = []
        for msg in ("first question", "second question"):
            child.sendline(msg)
            child.expect(STATS_RE)
            counts.append(int(child.match.group(1)))
            assert int(child.match.group(2)) == 8
            child.expect_exact("Chat: ")
        # turn 2's prompt holds turn 1 (question + 8-token answer) plus the new question
        assert counts[1] >= counts[0] + len("second question") + 8
        child.sendline('"""')
        child.sendline("line one")
        child.sendline("line two")
        child.sendline('"""')
        child.expect(STATS_RE)
        assert int(child.match.group(1)) > counts[1] + len("line one\nline two")
        child.expect_exact("Chat: ")
        child.sendline("")  # empty line → the prompt file
        child.expect_exact("[prompt from")
        child.expect(STATS_RE)
        child.expect_exact("Chat: ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


STOPPED = "[stopped: the question and the answer so far stay in the conversation; /undo forgets them]"


def test_interactive_ctrl_c_stops_generation_then_exits(tiny_model_dir):
    """A stopped turn stays in the conversation, question and partial answer; /undo forgets it."""
    d = tiny_model_dir("llama")
    pexpect, child = _spawn("--model_path", d, "--max_new_tokens", 20000, "--cpu_infer", 1, "--stats")
    try:
        child.expect_exact("Chat: ")
        child.sendline("tell me everything")
        child.expect("S{20}")  # the tiny llama answers with a long run of 'S'; it is generating now
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact(STOPPED, timeout=30)
        child.expect(STATS_RE)
        first_prompt, first_answer = int(child.match.group(1)), int(child.match.group(2))
        child.expect_exact("Chat: ")
        # still usable after the interruption, and the stopped turn is part of the next prompt
        child.sendline("again")
        time.sleep(1.5)  # 20000 tokens take a minute or more: it is generating now
        child.sendintr()
        child.expect_exact(STOPPED, timeout=30)
        child.expect(STATS_RE)
        assert int(child.match.group(1)) >= first_prompt + first_answer + len("again")
        child.expect_exact("Chat: ")
        child.sendline("/undo")
        child.expect_exact("[last question and answer forgotten; 1 turn(s) left]")
        child.expect_exact("Chat: ")
        child.sendline("/undo")
        child.expect_exact("[last question and answer forgotten; 0 turn(s) left]")
        child.expect_exact("Chat: ")
        child.sendline("/undo")
        child.expect_exact("[nothing to undo]")
        child.expect_exact("Chat: ")
        child.sendline("tell me everything")
        child.expect("S{20}")
        child.sendintr()
        child.expect_exact(STOPPED, timeout=30)
        child.expect(STATS_RE)
        assert int(child.match.group(1)) == first_prompt  # the forgotten turns are gone
        child.expect_exact("Chat: ")
        child.sendintr()  # a second Ctrl-C, now at the prompt: exit
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")


def test_interactive_absolute_path_sends_the_file_and_a_cut_answer_is_marked(tiny_model_dir, tmp_path):
    d = tiny_model_dir("llama")
    question = tmp_path / "question.txt"
    question.write_text("a question kept in a file")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00\x80")
    pexpect, child = _spawn("--model_path", d, "--max_new_tokens", 3, "--cpu_infer", 1, "--no-stats")
    try:
        child.expect_exact("Chat: ")
        child.sendline(str(question))  # an absolute path: the file, not a command
        child.expect_exact(f"[prompt from {question}: 25 characters]")
        child.expect_exact("[cut: the answer reached --max_new_tokens (3 tokens)]")
        child.expect_exact("Chat: ")
        child.sendline(str(tmp_path / "missing.txt"))
        child.expect_exact(f"[unknown command {tmp_path / 'missing.txt'} (and no such file)")
        child.expect_exact("Chat: ")
        child.sendline(str(binary))
        child.expect_exact(f"[cannot read {binary}: not UTF-8 text]")
        child.expect_exact("Chat: ")
        child.sendline("/" + str(question))  # //text sends the text itself
        child.expect_exact("[cut: the answer reached")
        assert "[prompt from" not in child.before
        child.expect_exact("Chat: ")
        child.sendline("x" * 300)  # longer than a file name may be: a message, not a path the system refuses
        child.expect_exact("[cut: the answer reached")
        assert "cannot read" not in child.before
        child.expect_exact("Chat: ")
        child.sendline("/" + "y" * 300)
        child.expect_exact("[unknown command /" + "y" * 76 + "... (and no such file)")
        child.expect_exact("Chat: ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_fuzz_typed_line_is_a_command_a_file_or_text(tmp_path):
    """Whatever is typed, deciding what it is never raises (a name too long, a NUL byte, a path)."""
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ktransformers.local_chat import COMMANDS, _is_command, _names_file

    f = tmp_path / "q.txt"
    f.write_text("q")
    lines = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=5000),
                      st.sampled_from([*COMMANDS, str(f), str(tmp_path), "//x"]).flatmap(
                          lambda s: st.tuples(st.just(s), st.text(max_size=8)).map("".join)),
                      st.text(min_size=1).map(lambda t: "/" + t * 300))

    @settings(max_examples=300, deadline=None, database=None)
    @given(lines)
    def check(line):
        is_cmd = _is_command(line)
        assert isinstance(is_cmd, bool) and isinstance(_names_file(line.strip()), bool)
        if line.strip() == str(f):
            assert not is_cmd  # an absolute path to a file sends the file
        if line.strip() in COMMANDS:
            assert is_cmd

    check()
