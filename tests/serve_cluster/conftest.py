"""Fixtures for the cluster tests: the server tests' tiny Qwen3-MoE (``tiny_dir``, ``tiny``), written
once per session."""

from __future__ import annotations

from tests.server.conftest import MODEL_NAME, tiny, tiny_dir  # noqa: F401 - fixtures shared with the server tests
