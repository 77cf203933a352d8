"""Command line: flags, --config YAML, one-line errors with exit code 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ktransformers.server.main import main, parse_settings


def _run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--port", "abc"], "invalid int value"),
    (["--model_path", "/no/such/dir"], "--model_path /no/such/dir: no such file"),
    ([], "no model"),
    (["--gguf_path", "/no/x.gguf"], "--gguf_path /no/x.gguf"),
    (["--config", "/no/cfg.yaml"], "--config /no/cfg.yaml: no such file"),
    (["--web", "maybe"], "--web"),
])
def test_bad_flags_one_line_exit_2(capsys, argv, needle):
    rc, err = _run(capsys, *argv)
    assert rc == 2 and needle in err and len(err.splitlines()) == 1 and err.startswith("error: ")


def test_bad_values(capsys, tiny_dir):
    for argv, needle in ((["--top_p", "0"], "--top_p"), (["--cache_lens", "4"], "--cache_lens"),
                         (["--port", "70000"], "--port"), (["--max_queue", "-1"], "--max_queue")):
        rc, err = _run(capsys, "--model_path", str(tiny_dir), *argv)
        assert rc == 2 and needle in err and len(err.splitlines()) == 1


def test_port_in_use(capsys, tiny_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = _run(capsys, "--model_path", str(tiny_dir), "--port", str(port), "--data_dir", str(tmp_path))
    assert rc == 2 and f"--port {port}" in err


def test_config_file_and_flag_override(tmp_path, tiny_dir):
    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"model_path: {tiny_dir}\nport: 12345\ntemperature: 0.7\nweb: true\nmax_queue: 3\n")
    s = parse_settings(["--config", str(cfg), "--port", "23456"])
    assert (s.port, s.temperature, s.web, s.max_queue) == (23456, 0.7, True, 3)
    assert s.host == "127.0.0.1" and s.default_model_name() == tiny_dir.name
    cfg.write_text("colour: red\n")
    with pytest.raises(Exception, match="unknown setting 'colour'"):
        parse_settings(["--config", str(cfg)])
    cfg.write_text(f"model_path: {tiny_dir}\nport: lots\n")
    with pytest.raises(Exception, match="'port'"):
        parse_settings(["--config", str(cfg)])


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "ktransformers.server", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--gguf_path" in r.stdout and "--api_key" in r.stdout
