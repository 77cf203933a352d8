"""docs/server.md says what the code and the tests do: the flag defaults as ``Settings`` has them (and
``--help`` says them; the prefix-cache table once said 1 GiB / 16 GiB where the flags are 0 / 0), and
the routes it says answer as local_chat does are the ones ``test_route_parity.py`` runs (it once
promised that of every route)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ktransformers.server.main import build_parser
from ktransformers.server.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
PARITY_TEST = Path(__file__).with_name("test_route_parity.py")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _numeric_defaults() -> dict[str, float]:
    out = {}
    for f in dataclasses.fields(Settings):
        if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            out[f"--{f.name}"] = float(f.default)
    return out


def _doc_rows() -> list[tuple[str, str]]:
    """(flag, default cell) for every table row of the doc that names flags in its first cell."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"`(--\w+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")] if len(flags) > 1 else [cells[1]]
        if len(defaults) != len(flags):
            defaults = [cells[1]] * len(flags)
        rows += list(zip(flags, defaults))
    return rows


def test_every_numeric_default_in_the_doc_is_the_flags():
    defaults = _numeric_defaults()
    seen = set()
    for flag, cell in _doc_rows():
        if flag not in defaults:
            continue
        m = NUMBER.match(cell)
        assert m, f"docs/server.md: {flag} default {cell!r} is not the number {defaults[flag]:g}"
        assert float(m.group()) == defaults[flag], (
            f"docs/server.md gives {flag} a default of {cell!r}; the flag's is {defaults[flag]:g}")
        seen.add(flag)
    assert {"--prefix_cache_ram_gb", "--prefix_cache_disk_gb", "--max_body_mb", "--max_new_tokens"} <= seen


def _help_defaults() -> list[tuple[str, str]]:
    """(flag, default) where ``--help`` ends a flag's text with a number in brackets and Settings has one."""
    numeric = _numeric_defaults()
    out = []
    for a in build_parser()._actions:
        m = re.search(r"\[([^\]]*)\]$", a.help or "")
        if m and NUMBER.fullmatch(m.group(1)) and f"--{a.dest}" in numeric:
            out.append((f"--{a.dest}", m.group(1)))
    return out


@pytest.mark.parametrize("flag, shown", _help_defaults(), ids=[f for f, _ in _help_defaults()])
def test_help_states_the_settings_default(flag, shown):
    assert float(shown) == _numeric_defaults()[flag], f"--help says {flag} [{shown}]; Settings differs"


def test_help_covers_the_prefix_cache_budgets():
    assert {"--prefix_cache_ram_gb", "--prefix_cache_disk_gb"} <= {f for f, _ in _help_defaults()}


def test_route_parity_claim_names_exactly_the_tested_routes():
    doc = " ".join(DOC.read_text().split())
    assert "each route gives local_chat's greedy answer" not in doc
    claim = doc[doc.index("What is tested over HTTP (`tests/server/test_route_parity.py`)"):]
    tested_part, _, rest = claim.partition("Not covered there:")
    not_covered = rest.split(".")[0]
    claimed = set(re.findall(r"`(/[a-z0-9/_]+)`", tested_part)) | (
        {"/v1/threads/runs"} if "Assistants run" in tested_part else set())
    posted = set(re.findall(r'c\.post\("(/[^"]+)"', PARITY_TEST.read_text())) - {"/v1/assistants"}
    assert claimed == posted, f"docs/server.md names {sorted(claimed)}; the test runs {sorted(posted)}"
    for route in ("/v1/responses",):  # a route the test does not run is said to be not covered
        assert (route in not_covered) == (route not in posted), route
