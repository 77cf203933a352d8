"""A chat template that does not compile stops local_chat and the server at start-up with one
named line (exit 2), instead of a jinja2 traceback on the first message."""

from __future__ import annotations

import json

import pytest

from ktransformers.errors import ConfigError

BROKEN = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"


def test_compile_names_the_template_line():
    from ktransformers.weights.gguf_checks import compile_chat_template

    with pytest.raises(ConfigError, match=r"^m.gguf: the chat template does not compile \(template line 2\): "):
        compile_chat_template(BROKEN, "m.gguf")
    compile_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", "m.gguf")
    compile_chat_template(None, "m.gguf")  # no template: plain completion


@pytest.fixture
def broken_template_dir(tmp_path):
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path / "m"
    write_tiny_model("qwen3_moe", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = BROKEN
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if (d / "chat_template.jinja").exists():
        (d / "chat_template.jinja").write_text(BROKEN)
    return d


def _one_error(capsys) -> str:
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, errors
    return errors[0]


def test_server_refuses_to_start(broken_template_dir, tmp_path, capsys):
    import socket

    from ktransformers.server.main import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--model_path", str(broken_template_dir), "--data_dir", str(tmp_path / "data"),
                 "--port", str(port)]) == 2
    assert "(tokenizer_config.json): the chat template does not compile (template line 2)" in _one_error(capsys)


def test_local_chat_refuses_to_start(broken_template_dir, capsys):
    from ktransformers.local_chat import main

    try:
        rc = main(["--model_path", str(broken_template_dir), "--prompt", "hi", "--max_new_tokens", "2"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "the chat template does not compile (template line 2)" in _one_error(capsys)
