"""``python -m ktransformers.doctor``: the machine report, its AMX verdict and its problem lines."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from ktransformers import cpuinfer_ext as ext
from ktransformers.doctor import amx_status, cpuinfo_flags, numa_nodes

AMX_CPU = {"amx_tile", "amx_int8", "amx_bf16", "avx512f"}
AMX_OS = {"amx_tile": True, "amx_int8": True, "amx_bf16": True, "amx_os_enabled": True}


def _never(*_):
    raise AssertionError("no permission request without the CPUID bits and the tile state")


@pytest.mark.parametrize("cpuid, features, ask, usable, needle", [
    ({"avx512f"}, {}, _never, False, "not in CPUID (amx_tile, amx_int8, amx_bf16 absent)"),
    ({"amx_tile", "amx_bf16"}, {}, _never, False, "not in CPUID (amx_int8 absent)"),
    (AMX_CPU, {**AMX_OS, "amx_tile": False}, _never, False, "the OS has not enabled the tile state (XCR0"),
    (AMX_CPU, AMX_OS, lambda: (False, errno.EINVAL), False, "ARCH_REQ_XCOMP_PERM) failed: the kernel does not know "
                                                            "the request (Linux before 5.16)"),
    (AMX_CPU, AMX_OS, lambda: (False, errno.EPERM), False, "failed: not permitted (a seccomp filter or sandbox)"),
    (AMX_CPU, {**AMX_OS, "amx_os_enabled": False}, lambda: (True, 0), False, "the kernels' own request"),
    (AMX_CPU, AMX_OS, lambda: (True, 0), True, "arch_prctl(ARCH_REQ_XCOMP_PERM) granted"),
])
def test_amx_verdict_names_the_first_missing_step(cpuid, features, ask, usable, needle):
    got = amx_status(cpuid, features, ask)
    assert got.usable is usable and needle in got.reason, got


def test_amx_verdict_agrees_with_the_kernels():
    """On this machine: AMX is usable exactly where the extension offers the amx tier."""
    assert amx_status(cpuinfo_flags(), ext.cpu_features()).usable == ("amx" in ext.supported_isa_tiers())


def test_cpuinfo_flags_and_numa_from_the_kernel_files(tmp_path):
    assert cpuinfo_flags("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\n") == {"fpu", "avx2", "amx_tile"}
    for i, cpus in ((1, "8-15"), (0, "0-7")):
        d = tmp_path / f"node{i}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {i} MemTotal:       2097152 kB\nNode {i} MemFree: 1 kB\n")
    assert numa_nodes(tmp_path) == [{"node": 0, "cpus": "0-7", "memory": 2 << 30},
                                    {"node": 1, "cpus": "8-15", "memory": 2 << 30}]


def _doctor(*args, **env):
    e = {k: v for k, v in os.environ.items() if k != "KT_ISA"}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "ktransformers.doctor", *args], capture_output=True, text=True,
                          env=e, timeout=120)


def test_report_says_tier_amx_threads_numa_ram_gpus_versions_caches(tmp_path):
    r = _doctor(KT_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    out = r.stdout
    best = ext.best_isa_tier()
    assert f"kernel tier: {best}: the best this CPU supports (KT_ISA unset)" in out
    for head in ("CPU: ", "AMX: ", "threads: ", "NUMA: ", "RAM: ", "versions: ", "packed-weight cache: "):
        assert any(line.startswith(head) for line in out.splitlines()), head
    assert "GPU" in out and "torch 2." in out and "transformers 5." in out and "gguf 0." in out
    assert f"tokenizer cache: {tmp_path / 'tokenizers'} (empty" in out
    js = _doctor("--json", KT_CACHE_DIR="off")
    data = json.loads(js.stdout)
    assert data["kernels"]["tier"] == best and data["problems"] == []
    assert data["caches"]["tokenizers"]["path"] is None
    assert data["memory"]["MemAvailable"] <= data["memory"]["MemTotal"]


def test_kt_isa_is_said_and_a_bad_one_is_a_problem_line():
    low = _doctor(KT_ISA="scalar")
    assert low.returncode == 0 and "kernel tier: scalar: KT_ISA=scalar" in low.stdout
    bad = _doctor(KT_ISA="avx9000")
    assert bad.returncode == 1 and "Traceback" not in bad.stdout + bad.stderr
    problems = [line for line in bad.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and "KT_ISA='avx9000' is not one of" in problems[0]


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TIERS = ["scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16", "amx"]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.one_of(st.sampled_from(TIERS + ["", "AVX2", " avx2"]),
                 st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=10)))
def test_fuzz_kt_isa(value):
    """Any KT_ISA: the tier it names where the CPU has it (empty: the best), else one problem line."""
    r = _doctor("--json", KT_ISA=value)
    assert "Traceback" not in r.stderr, r.stderr
    data = json.loads(r.stdout)
    if value == "" or value in ext.supported_isa_tiers():
        assert r.returncode == 0 and data["kernels"]["tier"] == (value or ext.best_isa_tier())
    else:
        assert r.returncode == 1 and data["kernels"]["tier"] is None and len(data["problems"]) == 1
        assert data["problems"][0].startswith("KT_ISA: KT_ISA")
