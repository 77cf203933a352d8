"""``python -m ktransformers.serve_cluster``: its refusals, before any Ray cluster starts."""

from __future__ import annotations

import socket
import sys

from ktransformers.serve_cluster.cli import main


def test_without_ray_one_line_names_the_extra(tiny_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as on a machine without it
    assert main(["--replicas", "2", "--model_path", str(tiny_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: Ray is not installed; install the cluster extra: pip install 'ktransformers[cluster]'"


def test_a_busy_port_is_refused_before_ray_starts(tiny_dir, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--model_path", str(tiny_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there") and "\n" not in err


def test_server_flags_are_the_servers(capsys):
    try:
        rc = main(["--replicas", "1", "--model_path", "/nonexistent/m", "--max_batch_size", "x"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--max_batch_size" in capsys.readouterr().err


def test_a_bad_ray_address_is_one_line(tiny_dir, capsys):
    import pytest

    pytest.importorskip("ray", reason="Ray is not installed (the cluster extra)")
    # ('auto' with no cluster is refused the same way, but would join one a developer has running)
    assert main(["--model_path", str(tiny_dir), "--ray_address", "not::an address"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --ray_address not::an address: Invalid address format: not::an address"
