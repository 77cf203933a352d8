"""``--chat_template NAME|FILE``: the resolver, local_chat, the server and sft; and sft's override errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ktransformers.errors import ConfigError
from ktransformers.util.chat_templates import (BUILTIN_TEMPLATES, named_templates, resolve_chat_template,
                                                use_chat_template)
from ktransformers.util.tiny_models import make_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


# ---- the resolver ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
               "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
    ("gemma", "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"),
    ("llama3", "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\n"),
])
def test_builtin_templates_render_the_model_families_formats(name, expected):
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    use_chat_template(tok, name)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == expected
    assert tok.kt_template_origin == f"the built-in template '{name}'"


def test_the_models_named_templates_come_first():
    meta = {"tokenizer.chat_template": "{{ 'default' }}", "tokenizer.chat_template.tool_use": "{{ 'tools' }}",
            "tokenizer.chat_template.chatml": "{{ 'the gguf chatml' }}"}
    assert named_templates(None, meta) == {"tool_use": "{{ 'tools' }}", "chatml": "{{ 'the gguf chatml' }}"}
    assert resolve_chat_template("tool_use", None, meta) == ("{{ 'tools' }}", "the model's template 'tool_use'")
    assert resolve_chat_template("chatml", None, meta)[0] == "{{ 'the gguf chatml' }}"
    tok = SimpleNamespace(chat_template={"default": "{{ 'd' }}", "rag": "{{ 'r' }}"})
    assert resolve_chat_template("rag", tok)[0] == "{{ 'r' }}"
    assert resolve_chat_template("llama3", tok)[0] == BUILTIN_TEMPLATES["llama3"]


def test_a_file_is_read_as_jinja(tmp_path):
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = make_tiny_tokenizer()
    use_chat_template(tok, str(f))
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True) == \
        "[user] Hi\n[assistant] "
    assert tok.kt_template_origin == str(f)


@pytest.mark.parametrize("body, needle", [
    ("line one\n{% for m in messages %}\n{{ m.content }\n{% endfor %}\n", ":3: the chat template does not compile"),
    ("{% for m in messages %}\n{{ m.content }}\n{% endfor %}\n{{ undefined_thing.x }}\n",
     ":4: the chat template does not render a one-message conversation: UndefinedError"),
    ("ok\n\n{{ raise_exception('system messages only') }}", ":3: the chat template does not render"),
    ("  \n", ": the chat template file is empty"),
])
def test_a_bad_template_file_is_one_line_naming_file_and_line(tmp_path, body, needle):
    f = tmp_path / "bad.jinja"
    f.write_text(body)
    with pytest.raises(ConfigError) as e:
        use_chat_template(make_tiny_tokenizer(), str(f))
    assert str(e.value).startswith(f"{f}{needle}") and "\n" not in str(e.value), str(e.value)


def test_unknown_names_and_missing_files(tmp_path):
    tok = make_tiny_tokenizer()
    with pytest.raises(ConfigError, match=r"^--chat_template chatlm: no such file, and not a template name "
                                          r"\(names: tool_use, chatml, gemma, llama3\)$"):
        use_chat_template(tok, "chatlm", {"tokenizer.chat_template.tool_use": "x"})
    with pytest.raises(ConfigError, match=r"no_such\.jinja: no such file$"):
        use_chat_template(tok, str(tmp_path / "no_such.jinja"))
    with pytest.raises(ConfigError, match="a folder, not a Jinja file"):
        use_chat_template(tok, str(tmp_path))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # unchanged by the failures


# ---- local_chat -------------------------------------------------------------------------------

def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _chat(*args):
    return subprocess.run([sys.executable, "-m", "ktransformers.local_chat", *map(str, args)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama without a chat template: a base model."""
    d = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_model_dir("llama"), d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_local_chat_base_model_says_how_to_add_a_template_and_takes_one(base_model_dir, tmp_path):
    plain = _chat("--model_path", base_model_dir, "--prompt", "Hi", "--max_new_tokens", 2, "--stats", "--cpu_infer", 1)
    assert plain.returncode == 0, plain.stderr
    hint = [ln for ln in plain.stderr.splitlines() if "no chat template" in ln]
    assert len(hint) == 1 and "--chat_template" in hint[0], plain.stderr
    given = _chat("--model_path", base_model_dir, "--prompt", "Hi", "--max_new_tokens", 2, "--stats",
                  "--cpu_infer", 1, "--chat_template", "chatml")
    assert given.returncode == 0, given.stderr
    assert "no chat template" not in given.stderr

    def prompt_tokens(r):
        return int(r.stderr.split("prompt eval count: ")[1].split()[0])

    # "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": 3 special tokens + 18 bytes, against "Hi"
    assert prompt_tokens(given) == 21 and prompt_tokens(plain) == 2
    bad = tmp_path / "t.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n{% endfor\n")
    r = _chat("--model_path", base_model_dir, "--prompt", "Hi", "--chat_template", bad, "--progress")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith(f"error: {bad}:3: the chat template does not compile"), r.stderr
    assert "Traceback" not in r.stderr and "reading" not in r.stderr  # before the weights are opened


# ---- the server -------------------------------------------------------------------------------

def test_server_flag_reaches_the_engine(tiny_model_dir, tmp_path, one_torch_thread, caplog):
    from ktransformers.server.main import build_engine, build_parser, parse_settings

    assert "--chat_template" in build_parser().format_help()
    d = tiny_model_dir("llama")
    settings = parse_settings(["--model_path", str(d), "--device", "cpu", "--chat_template", "gemma",
                               "--backend_type", "ktransformers"])
    assert settings.chat_template == "gemma"
    engine = build_engine(settings)
    assert engine.chat_template == BUILTIN_TEMPLATES["gemma"]
    text = engine.decode(engine.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"model_path: {d}\nchat_template: {tmp_path / 'none.jinja'}\n")
    with pytest.raises(ConfigError, match=r"none\.jinja: no such file"):
        build_engine(parse_settings(["--config", str(cfg), "--device", "cpu"]))


def test_server_warns_when_the_model_has_no_template(base_model_dir, one_torch_thread, caplog):
    from ktransformers.server.main import build_engine, parse_settings

    with caplog.at_level("WARNING", logger="ktransformers.server"):
        build_engine(parse_settings(["--model_path", str(base_model_dir), "--device", "cpu",
                                     "--backend_type", "ktransformers"]))
    assert "no chat template" in caplog.text and "--chat_template" in caplog.text


# ---- sft ----------------------------------------------------------------------------------------

SFT_CFG = "model_name_or_path: {model}\ndataset: {data}\noutput_dir: {out}\nlearning_rate: 1.0e-4\n"


def _sft_config(tmp_path, model, extra=""):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": "Say hi", "output": "Hi there"}]))
    cfg = tmp_path / "train.yaml"
    cfg.write_text(SFT_CFG.format(model=model, data=data, out=tmp_path / "out") + extra)
    return cfg


def test_sft_override_error_names_the_override(tmp_path, capsys):
    from ktransformers.sft.__main__ import main

    cfg = _sft_config(tmp_path, tmp_path)
    assert main([str(cfg), "learning_rate=fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: command-line override 'learning_rate=fast': learning_rate: must be a number, not 'fast'"]
    assert main([str(cfg), "lora_rank=["]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: command-line override 'lora_rank=[': not valid YAML"), err
    assert main([str(cfg), "lora_rank=4", "chat_template=chatml", "template=qwen"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: command-line override 'chat_template=chatml': chat_template: and template: qwen"), err


def test_sft_trains_and_chats_with_the_chat_template(base_model_dir, tmp_path, monkeypatch):
    """sft's ``chat_template`` key formats the training examples and is passed on to chat."""
    import ktransformers.local_chat as local_chat
    import ktransformers.sft.model as sft_model
    import ktransformers.sft.trainer as sft_trainer
    from ktransformers.sft.__main__ import main

    tok = make_tiny_tokenizer()
    tok.chat_template = None
    monkeypatch.setattr(sft_model, "load_training_model",
                        lambda cfg, log: SimpleNamespace(model=SimpleNamespace(), tokenizer=tok))
    seen = {}

    class Stop(Exception):
        pass

    def trainer(cfg, tm, rows, log):
        seen["rows"] = rows
        raise Stop

    monkeypatch.setattr(sft_trainer, "Trainer", trainer)
    cfg = _sft_config(tmp_path, base_model_dir)
    assert main([str(cfg)]) == 2  # no template: the error names both ways to give one
    with pytest.raises(Stop):
        main([str(cfg), "chat_template=gemma"])
    ids, labels = seen["rows"][0]
    assert tok.decode(ids) == ("<start_of_turn>user\nSay hi<end_of_turn>\n<start_of_turn>model\n"
                               "Hi there<end_of_turn>\n")
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100]) == "Hi there<end_of_turn>\n"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ nope(\n")

    def must_not_load(cfg, log):
        raise AssertionError("the model loaded before the template was checked")

    monkeypatch.setattr(sft_model, "load_training_model", must_not_load)
    with pytest.raises(ConfigError, match=rf"^{bad}:1: the chat template does not compile"):
        from ktransformers.sft.__main__ import _with_overrides, train
        train(_with_overrides(str(cfg), [f"chat_template={bad}"]), print)
    with pytest.raises(ConfigError, match=r"command-line override 'chat_template=missing\.jinja': chat_template "
                                          r"missing\.jinja: no such file"):
        train(_with_overrides(str(cfg), ["chat_template=missing.jinja"]), print)

    argv = {}
    monkeypatch.setattr(local_chat, "main", lambda a: argv.setdefault("argv", a) and 0)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapter_config.json").write_text("{}")
    (tmp_path / "out" / "adapter_model.safetensors").write_bytes(b"")
    main(["chat", str(cfg), "chat_template=llama3"])
    assert argv["argv"][-2:] == ["--chat_template", "llama3"]
