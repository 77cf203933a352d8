"""The README's layout section and docs/architecture.md name only what the tree holds, and the
layout names every package: a rename or a new package without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ktransformers"


def _layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def _layout_paths() -> list[str]:
    """Every path the layout block names: top-level lines, the package's indented entries, and the
    folders of the closing ``examples/ tests/ …`` line."""
    out, under = [], ""
    for line in _layout_block():
        if not line.strip() or line.startswith(" " * 10):  # a continuation of the line above
            continue
        first = line.split()[0]
        if line.startswith("  "):
            out.append(under + first)
        elif line.rstrip().endswith("/") and len(line.split()) == 1:
            under = first  # "ktransformers/": the lines below are inside it
            out.append(first)
        elif all(w.endswith("/") for w in line.split()):
            out += line.split()
        else:
            out.append(first)
    return out


def test_every_path_the_layout_names_exists():
    paths = _layout_paths()
    assert "ktransformers/operators/" in paths and "csrc/" in paths and "docs/" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README layout names what the tree lacks: {missing}"


def test_the_layout_names_every_package_and_top_level_module():
    named = set(_layout_paths())
    have = {f"ktransformers/{d.name}/" for d in PKG.iterdir() if (d / "__init__.py").is_file()}
    have |= {f"ktransformers/{f.name}" for f in PKG.glob("*.py") if f.name != "__init__.py"}
    have.add("ktransformers/optimize_rules/")
    unnamed = sorted(have - named)
    assert not unnamed, f"README layout leaves out: {unnamed}"


_DOC_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|cpp|inc|h|md|yaml))\b")


def _resolve(name: str) -> bool:
    """A path from the repository, the package, csrc/ or docs/; a bare file name (``pool.py`` in a
    sentence about ``kernels/``) anywhere in the package or csrc/."""
    if any((base / name).exists() for base in (ROOT, PKG, ROOT / "csrc", ROOT / "docs", ROOT / "tests")):
        return True
    return "/" not in name and any(True for base in (PKG, ROOT / "csrc") for _ in base.rglob(name))


def test_every_file_architecture_md_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = set(_DOC_PATH.findall(text))
    assert "optimize/plan.py" in names and "operators/formats.py" in names
    missing = sorted(n for n in names if not _resolve(n) and not n.startswith(("kern_", "rules.yaml")))
    assert not missing, f"docs/architecture.md names files the tree lacks: {missing}"


def test_architecture_md_draws_both_paths_and_the_layer_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for heading in ("## The two paths", "## Layer order", "## Where a new … goes"):
        assert heading in text
    for step in ("load_for_generation()", "plan_model()", "Plan.decide_formats()", "apply_plan()",
                 "GGUFSource.raw(name)", "MoEKernel(", "MoE::forward()"):
        assert step in text, step
