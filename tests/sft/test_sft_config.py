"""Bad fine-tuning configs and datasets: one ``error:`` line naming the key (file:line) or the record, exit 2."""

from __future__ import annotations

import json

import pytest

from ktransformers.errors import ConfigError
from ktransformers.sft.__main__ import main
from ktransformers.sft.config import KEYS, parse_config
from ktransformers.sft.data import load_examples

GOOD = """model_name_or_path: {model}
stage: sft
finetuning_type: lora
lora_target: q_proj,v_proj
dataset: {data}
output_dir: {out}
"""


def _run(tmp_path, capsys, text: str):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(text)
    rc = main([str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err, cfg


@pytest.mark.parametrize("extra, needle", [
    ("learning_rat: 1.0e-4\n", "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
    ("lora_rank: eight\n", "lora_rank: must be an integer, not 'eight'"),
    ("lora_rank: 0\n", "lora_rank: must be greater than 0, not 0"),
    ("bf16: 1\n", "bf16: must be true/false, not 1"),
    ("lr_scheduler_type: cosin\n", "lr_scheduler_type: 'cosin' is not one of linear, cosine"),
    ("report_to: wandb\n", "report_to: 'wandb' is not one of none"),
    ("stage: sft\n", "stage: given twice (first on line 2)"),
    ("warmup_ratio: 1.5\n", "warmup_ratio: must be below 1"),
    ("max_steps: 0\n", "max_steps: must be positive, or -1"),
    ("infer_backend: vllm\n", "infer_backend: 'vllm' is not one of ktransformers"),
])
def test_bad_key_or_value_names_file_line_and_key(tmp_path, capsys, extra, needle):
    text = GOOD.format(model=tmp_path, data="d.json", out=tmp_path / "o") + extra
    rc, err, cfg = _run(tmp_path, capsys, text)
    assert rc == 2 and len(err) == 1, err
    line = len(text.splitlines())
    assert err[0].startswith(f"error: {cfg}:{line}: "), err  # cross-key checks name the key's line too
    assert needle in err[0], err


def test_missing_required_keys(tmp_path, capsys):
    rc, err, cfg = _run(tmp_path, capsys, "stage: sft\n")
    assert rc == 2 and len(err) == 1 and "model_name_or_path: required" in err[0]
    rc, err, _ = _run(tmp_path, capsys, f"model_name_or_path: {tmp_path}\n")
    assert rc == 2 and len(err) == 1 and "dataset: required for training" in err[0]


def test_not_yaml_and_not_a_mapping(tmp_path, capsys):
    rc, err, cfg = _run(tmp_path, capsys, "a: [1,\n")
    assert rc == 2 and len(err) == 1 and "not valid YAML" in err[0]
    rc, err, cfg = _run(tmp_path, capsys, "- 1\n")
    assert rc == 2 and len(err) == 1 and "must be a mapping" in err[0]
    rc = main([str(tmp_path / "absent.yaml")])
    assert rc == 2 and "no such config file" in capsys.readouterr().err


def test_every_key_has_a_valid_default():
    for key, spec in KEYS.items():
        if spec.default is not None:
            from ktransformers.sft.config import check_value

            assert check_value(key, spec.default) is None, key


def test_defaults_and_lists(tmp_path):
    cfg = parse_config(GOOD.format(model=tmp_path, data="a.json, b.jsonl", out="o"), "c.yaml")
    assert cfg.datasets() == ["a.json", "b.jsonl"] and cfg.targets() == ["q_proj", "v_proj"]
    assert cfg.alpha == 16.0 and cfg.lr_scheduler_type == "cosine" and cfg.where("dataset") == "c.yaml:5: dataset"


def test_override_on_the_command_line_is_checked(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(GOOD.format(model=tmp_path, data="d.json", out=tmp_path / "o"))
    assert main([str(cfg), "lora_rank=-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora_rank: must be greater than 0" in err[0]


# ---- datasets --------------------------------------------------------------------------------

def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("records, needle", [
    ('[\n {"instruction": "a", "output": "b"},\n {"instruction": "a"}\n]\n', ":3: record has no 'output'"),
    ('[\n {"instruction": "a", "output": 5}\n]\n', ":2: 'output' must be text, not int"),
    ('[\n {"conversations": [{"from": "gpt", "value": "x"}]}\n]\n', ":2: conversations[0] is a assistant turn"),
    ('[\n {"conversations": [{"from": "bot", "value": "x"}]}\n]\n', ":2: conversations[0].from is 'bot'"),
    ('[\n {"messages": [{"role": "user", "content": "x"}]}\n]\n', ":2: the conversation must end with an assistant"),
    ('[\n {"prompt": "x"}\n]\n', ":2: neither alpaca"),
    ('[\n {"instruction": "a", "output": "b"}\n {"instruction": "a", "output": "b"}\n]\n', ":3: expected ','"),
    ('[\n {"instruction": "a", "output": "b",}\n]\n', ":2: not valid JSON"),
    ('{"instruction": "a"}', ":1: a .json dataset must be a list of records"),
])
def test_bad_json_record_names_file_and_line(tmp_path, records, needle):
    f = _write(tmp_path / "d.json", records)
    with pytest.raises(ConfigError) as e:
        load_examples([str(f)], tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(f)) and needle in msg, msg


def test_bad_jsonl_record_names_its_line(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    f = _write(tmp_path / "d.jsonl", f"{good}\n\n{good}\n{{\"messages\": 3}}\n")
    with pytest.raises(ConfigError, match=rf"^{f}:4: 'messages' must be a non-empty list$"):
        load_examples([str(f)], tmp_path)


def test_formats_become_the_same_messages(tmp_path):
    a = _write(tmp_path / "a.json", json.dumps([{"instruction": "Q", "input": "ctx", "output": "A", "system": "S",
                                                 "history": [["q0", "a0"]]}]))
    s = _write(tmp_path / "s.jsonl", json.dumps({"system": "S", "conversations": [
        {"from": "human", "value": "q0"}, {"from": "gpt", "value": "a0"},
        {"from": "human", "value": "Q\nctx"}, {"from": "gpt", "value": "A"}]}) + "\n")
    info = _write(tmp_path / "dataset_info.json", json.dumps({"mine": {"file_name": "s.jsonl",
                                                                       "formatting": "sharegpt"}}))
    assert info.is_file()
    ea, es, en = load_examples(["a.json", "s.jsonl", "mine"], tmp_path)
    assert ea.messages == es.messages == en.messages
    assert ea.messages[0] == {"role": "system", "content": "S"} and ea.where == f"{a}:1"
    with pytest.raises(ConfigError, match="dataset: 'nope' is neither a file nor a name"):
        load_examples(["nope"], tmp_path)


def test_dataset_error_through_the_entry_point_is_one_line(tmp_path, capsys, tiny_model_dir):
    d = _write(tmp_path / "d.json", '[\n {"instruction": "a", "output": "b"},\n {"instruction": 1, "output": "b"}\n]')
    model = tiny_model_dir("qwen3_moe")
    capsys.readouterr()
    rc, err, _ = _run(tmp_path, capsys, GOOD.format(model=model, data=d, out=tmp_path / "o"))
    assert rc == 2 and err == [f"error: {d}:3: 'instruction' must be text, not int"]
