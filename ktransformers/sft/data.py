"""Datasets: local JSON / JSONL files in the alpaca or sharegpt layout, as chat messages.

Each record becomes ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` (user and
assistant alternating, ending with the assistant).  A bad record is a one-line ConfigError naming
the file and the line the record starts on.

* alpaca: ``instruction``, optional ``input`` (appended to the instruction after a newline),
  ``output``, optional ``system`` and ``history`` (``[[user, assistant], ...]`` before this turn);
* sharegpt: ``conversations`` of ``{"from": human|user|gpt|assistant|system, "value": ...}``, or
  ``messages`` of ``{"role": user|assistant|system, "content": ...}``; optional ``system``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .config import read_text

_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "system": "system"}


@dataclass
class Example:
    messages: list[dict]
    where: str  # file:line


def _records_json_array(text: str, path: Path):
    """(line, record) of each element of a top-level JSON array, with the line it starts on."""
    dec = json.JSONDecoder()
    n = len(text)
    i = 0
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "[":
        line = text.count("\n", 0, i) + 1
        raise ConfigError(f"{path}:{line}: a .json dataset must be a list of records")
    i += 1
    expect_value = True
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            raise ConfigError(f"{path}:{text.count(chr(10)) + 1}: the list of records is not closed with ']'")
        if text[i] == "]":
            return
        if not expect_value:
            if text[i] != ",":
                raise ConfigError(f"{path}:{text.count(chr(10), 0, i) + 1}: expected ',' between records")
            i += 1
            expect_value = True
            continue
        line = text.count("\n", 0, i) + 1
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        yield line, obj
        i = end
        expect_value = False


def _records_jsonl(text: str, path: Path):
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            yield lineno, json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None


def read_records(path: Path):
    """(line, record) pairs of a .json (list) or .jsonl (one record a line) file."""
    text = read_text(path, "dataset")
    if path.suffix == ".jsonl":
        return list(_records_jsonl(text, path))
    if path.suffix == ".json":
        return list(_records_json_array(text, path))
    raise ConfigError(f"{path}: dataset files must be .json or .jsonl")


def _text(rec: dict, key: str, where: str, required: bool = True) -> str:
    v = rec.get(key)
    if v is None:
        if required:
            raise ConfigError(f"{where}: record has no '{key}'")
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{where}: '{key}' must be text, not {type(v).__name__}")
    return v


def alpaca_messages(rec: dict, where: str) -> list[dict]:
    instruction = _text(rec, "instruction", where)
    extra = _text(rec, "input", where, required=False)
    output = _text(rec, "output", where)
    system = _text(rec, "system", where, required=False)
    msgs = [{"role": "system", "content": system}] if system else []
    history = rec.get("history") or []
    if not isinstance(history, list):
        raise ConfigError(f"{where}: 'history' must be a list of [user, assistant] pairs")
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise ConfigError(f"{where}: history[{i}] must be a [user, assistant] pair of texts")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n{extra}" if extra else instruction
    return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def sharegpt_messages(rec: dict, where: str) -> list[dict]:
    if "conversations" in rec:
        key, role_key, text_key = "conversations", "from", "value"
    else:
        key, role_key, text_key = "messages", "role", "content"
    turns = rec.get(key)
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: '{key}' must be a non-empty list")
    msgs = []
    system = _text(rec, "system", where, required=False)
    if system:
        msgs.append({"role": "system", "content": system})
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: {key}[{i}] must be an object with '{role_key}' and '{text_key}'")
        role = t.get(role_key)
        if role not in _ROLE:
            raise ConfigError(f"{where}: {key}[{i}].{role_key} is {role!r}; expected one of "
                              f"{', '.join(sorted(_ROLE))}")
        content = t.get(text_key)
        if not isinstance(content, str):
            raise ConfigError(f"{where}: {key}[{i}].{text_key} must be text")
        role = _ROLE[role]
        if role == "system":
            if msgs and not (i == 0 and not system):
                raise ConfigError(f"{where}: {key}[{i}]: a system message may only come first")
            msgs.append({"role": "system", "content": content})
            continue
        want = "user" if not msgs or msgs[-1]["role"] != "user" else "assistant"
        if role != want:
            raise ConfigError(f"{where}: {key}[{i}] is a {role} turn where a {want} turn belongs "
                              "(turns must alternate user, assistant)")
        msgs.append({"role": role, "content": content})
    if msgs[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: the conversation must end with an assistant turn")
    return msgs


def record_messages(rec, where: str) -> list[dict]:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, not {type(rec).__name__}")
    if "conversations" in rec or "messages" in rec:
        return sharegpt_messages(rec, where)
    if "instruction" in rec or "output" in rec:
        return alpaca_messages(rec, where)
    raise ConfigError(f"{where}: neither alpaca (instruction/output) nor sharegpt (conversations/messages) "
                      f"record; keys: {', '.join(sorted(rec)) or 'none'}")


def resolve_dataset(name: str, dataset_dir: Path) -> Path:
    """A dataset path, or a name in ``dataset_dir/dataset_info.json`` (its ``file_name``)."""
    p = Path(name).expanduser()
    candidates = [p] if p.is_absolute() else [p, dataset_dir / p]
    for c in candidates:
        if c.is_file():
            return c
    info = dataset_dir / "dataset_info.json"
    if info.is_file():
        try:
            table = json.loads(info.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{info}: cannot read it ({e})") from None
        entry = table.get(name) if isinstance(table, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("file_name"), str):
            f = dataset_dir / entry["file_name"]
            if f.is_file():
                return f
            raise ConfigError(f"{info}: dataset '{name}' names {f}, which does not exist")
    raise ConfigError(f"dataset: '{name}' is neither a file nor a name in {info}")


def load_examples(names: list[str], dataset_dir: Path, max_samples: int | None = None) -> list[Example]:
    out: list[Example] = []
    for name in names:
        path = resolve_dataset(name, dataset_dir)
        records = read_records(path)
        if max_samples is not None:
            records = records[:max_samples]
        for line, rec in records:
            where = f"{path}:{line}"
            out.append(Example(record_messages(rec, where), where))
        if not records:
            raise ConfigError(f"{path}: the dataset holds no records")
    return out
