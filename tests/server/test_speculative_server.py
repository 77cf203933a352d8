"""``--speculative`` on the server: the single-request engine guesses and gives the plain answers,
acceptance is counted in /metrics; the batching engine decodes plainly; bad values are one line."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from .conftest import REPO, start_server, stop_server

PROMPT = "abc abc abc abc abc abc abc abc abc"


def _complete(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _counter(url, name):
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_single_request_engine_speculates_with_the_plain_answer(tiny_dir, tmp_path):
    plain, url = start_server(tiny_dir, tmp_path / "a", tmp_path / "a.log", "--backend_type", "ktransformers")
    try:
        want = _complete(url)
    finally:
        stop_server(plain)
    spec, url = start_server(tiny_dir, tmp_path / "b", tmp_path / "b.log", "--backend_type", "ktransformers",
                             "--speculative", f"draft:{tiny_dir}", "--draft_max", "4")
    try:
        assert _complete(url) == want
        drafted = _counter(url, "ktransformers_speculative_drafted_tokens")
        accepted = _counter(url, "ktransformers_speculative_accepted_tokens")
        assert drafted > 0 and accepted == drafted  # the model as its own draft: every guess kept
    finally:
        stop_server(spec)


def test_batching_engine_says_it_decodes_plainly(tiny_dir, tmp_path):
    proc, url = start_server(tiny_dir, tmp_path / "c", tmp_path / "c.log", "--speculative", "ngram")
    try:
        _complete(url)
    finally:
        stop_server(proc)
    assert "the batching engine decodes plainly" in (tmp_path / "c.log").read_text()


@pytest.mark.parametrize("args,message", [
    (["--speculative", "eagle"], "choose ngram, mtp or draft:PATH"),
    (["--speculative", "draft:/nonexistent/m.gguf"], "--speculative draft:/nonexistent/m.gguf: no such file"),
    (["--speculative", "ngram", "--draft_max", "0"], "--draft_max must be between 1 and 32"),
])
def test_bad_speculative_values_are_one_line(tiny_dir, tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "ktransformers.server", "--model_path", str(tiny_dir),
                        "--data_dir", str(tmp_path), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
