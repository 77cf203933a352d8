"""``python -m ktransformers.doctor``: what this machine offers the project, in one screen.

The CPU and the kernel tier in force (and why: the best the CPU supports, or ``KT_ISA``), whether
AMX is usable (CPUID, the OS tile state, Linux's permission request), threads, NUMA nodes, RAM,
GPUs, the versions that matter and the caches.  Everything is read, nothing is changed (the AMX
permission request is what the kernels make at start-up anyway).  Each problem found is one
``problem:`` line; the exit code is 1 when there is one.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

#: Linux x86-64: the arch_prctl system call and its extended-state permission requests
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AMX_CPUID_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")  # /proc/cpuinfo names of the CPUID bits


@dataclass
class AmxStatus:
    usable: bool
    reason: str


def cpuinfo_flags(text: str | None = None) -> set[str]:
    """CPUID feature flags as the kernel lists them (``flags`` of ``/proc/cpuinfo``)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def request_amx_permission() -> tuple[bool, int]:
    """Ask Linux for the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM): (granted, errno)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return rc == 0, (0 if rc == 0 else ctypes.get_errno())


def amx_status(cpuid: set[str], features: dict, request=request_amx_permission) -> AmxStatus:
    """Whether the AMX kernels can run, and the first reason they cannot: the CPU's CPUID bits, the
    OS's tile state in XCR0 (the extension reports ``amx_tile`` only where both hold), then Linux's
    per-process permission (kernel 5.16 and later; refused on older kernels or under seccomp)."""
    missing = [f for f in AMX_CPUID_FLAGS if f not in cpuid]
    if missing:
        return AmxStatus(False, f"not in CPUID ({', '.join(missing)} absent): this CPU has no AMX tiles")
    if not features.get("amx_tile"):
        return AmxStatus(False, "in CPUID, but the OS has not enabled the tile state (XCR0 bits 17-18)")
    granted, err = request()
    if not granted:
        why = {errno.EINVAL: "the kernel does not know the request (Linux before 5.16)",
               errno.EPERM: "not permitted (a seccomp filter or sandbox)",
               errno.ENOSYS: "no arch_prctl on this system"}.get(err, os.strerror(err) if err else "refused")
        return AmxStatus(False, f"in CPUID and XCR0, but arch_prctl(ARCH_REQ_XCOMP_PERM) failed: {why}")
    if not features.get("amx_os_enabled"):
        return AmxStatus(False, "in CPUID and XCR0, permission granted now, but the kernels' own request at "
                                "start-up failed")
    return AmxStatus(True, "in CPUID and XCR0, arch_prctl(ARCH_REQ_XCOMP_PERM) granted")


def kernel_tier(ext, env: str | None) -> tuple[dict, list[str]]:
    """The tier in force and why, the tiers the CPU supports, the feature flags it lacks."""
    problems: list[str] = []
    best = ext.best_isa_tier()
    supported = list(ext.supported_isa_tiers())
    try:
        tier = ext.isa_tier()
    except (ValueError, RuntimeError) as e:
        tier = None
        problems.append(f"KT_ISA: {e}")
    if tier is None:
        why = f"KT_ISA={env} cannot be used (the problem line says why)"
    elif env:
        why = f"KT_ISA={env}" + ("" if tier == best else f" (the CPU's best is {best})")
    else:
        why = "the best this CPU supports (KT_ISA unset)"
    features = ext.cpu_features()
    out = {
        "tier": tier, "why": why, "best": best, "supported": supported,
        "absent_features": sorted(k for k, v in features.items() if not v),
        "kernel_table": ext.kernel_table() if tier is not None else None,
        "amx_tiles_prefill": os.environ.get("KT_AMX_TILES", "0") == "1",
    }
    return out, problems


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[dict]:
    """Each NUMA node's CPUs and memory (Linux sysfs); one node where the machine has no NUMA."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
            total = next((int(ln.split()[3]) * 1024 for ln in (d / "meminfo").read_text().splitlines()
                          if "MemTotal:" in ln), None)
        except (OSError, ValueError, IndexError):
            continue
        nodes.append({"node": int(d.name[4:]), "cpus": cpus, "memory": total})
    return nodes


def meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def folder_size(path: Path | None) -> tuple[int, int] | None:
    """(files, bytes) under ``path``; None where it does not exist."""
    if path is None or not path.is_dir():
        return None
    n = size = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                n += 1
                size += p.stat().st_size
        except OSError:
            continue
    return n, size


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("ktransformers", "torch", "transformers", "gguf", "tokenizers", "safetensors", "accelerate", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def gpus() -> dict:
    import torch

    info: dict = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda, "devices": []}
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            try:
                free = int(torch.cuda.mem_get_info(i)[0])
            except RuntimeError:
                free = None
            info["devices"].append({"index": i, "name": p.name, "memory": int(p.total_memory), "free": free,
                                    "capability": f"{p.major}.{p.minor}"})
    return info


def threads() -> dict:
    import torch

    from .operators.cpu_threads import cpu_infer_threads, physical_cores

    return {"logical": os.cpu_count(), "usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "physical_cores": physical_cores(), "kernel_pool": cpu_infer_threads(),
            "torch": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in ("KT_TORCH_THREADS", "OMP_NUM_THREADS") if k in os.environ}}


def collect() -> tuple[dict, list[str]]:
    """Everything the report shows, and the problems found."""
    from . import cpuinfer_ext as ext
    from .kernels.packed_cache import cache_dir
    from .weights.gguf_tokenizer import cache_root

    problems: list[str] = []
    tier, tier_problems = kernel_tier(ext, os.environ.get("KT_ISA"))
    problems += tier_problems
    amx = amx_status(cpuinfo_flags(), ext.cpu_features())
    tok_root = cache_root()
    tok_dir = tok_root / "tokenizers" if tok_root is not None else None
    packed = cache_dir()
    report = {
        "cpu": {"model": cpu_model(), "machine": platform.machine(), "os": platform.platform()},
        "kernels": tier,
        "amx": {"usable": amx.usable, "reason": amx.reason},
        "threads": threads(),
        "numa": numa_nodes(),
        "memory": meminfo(),
        "gpus": gpus(),
        "versions": versions(),
        "caches": {
            "tokenizers": {"path": str(tok_dir) if tok_dir else None, "contents": folder_size(tok_dir)},
            "packed_experts": {"path": str(packed) if packed else None, "contents": folder_size(packed)},
        },
    }
    return report, problems


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def _cache_line(name: str, env: str, c: dict) -> str:
    if c["path"] is None:
        return f"{name}: off ({env})"
    got = c["contents"]
    held = "empty (not made yet)" if not got else f"{got[0]} files, {got[1] / 2**20:.1f} MiB"
    return f"{name}: {c['path']} ({held}; {env} moves it, {env}=off disables it)"


def format_report(r: dict, problems: list[str]) -> str:
    k, t, m, g = r["kernels"], r["threads"], r["memory"], r["gpus"]
    lines = [
        f"CPU: {r['cpu']['model']} ({r['cpu']['machine']}, {r['cpu']['os']})",
        f"kernel tier: {k['tier'] or 'none'}: {k['why']}; supported: {', '.join(k['supported'])}",
        f"  CPU features absent: {', '.join(k['absent_features']) or 'none'}",
        f"  AMX tiles for prefill (KT_AMX_TILES=1): {'on' if k['amx_tiles_prefill'] else 'off'}",
        f"AMX: {'usable' if r['amx']['usable'] else 'not usable'}: {r['amx']['reason']}",
        f"threads: {t['logical']} logical, {t['usable']} usable by this process, {t['physical_cores']} physical "
        f"cores; CPU kernels {t['kernel_pool']} (--cpu_infer), torch {t['torch']}"
        + (f" ({', '.join(f'{a}={b}' for a, b in t['env'].items())})" if t["env"] else ""),
        "NUMA: " + ("; ".join(f"node {n['node']}: CPUs {n['cpus']}, {_gib(n['memory'])}" for n in r["numa"])
                    or "no NUMA information"),
        f"RAM: {_gib(m.get('MemTotal'))} total, {_gib(m.get('MemAvailable'))} available; "
        + (f"swap {_gib(m['SwapTotal'])} ({_gib(m.get('SwapFree'))} free)" if m.get("SwapTotal") else "no swap"),
    ]
    if g["devices"]:
        lines += [f"GPU {d['index']}: {d['name']} (compute {d['capability']}), {_gib(d['memory'])}, "
                  f"{_gib(d['free'])} free" for d in g["devices"]]
    else:
        lines.append(f"GPU: none (torch {'built with CUDA ' + g['torch_cuda'] if g['torch_cuda'] else 'CPU-only build'})"
                     "; the -cpu rule files, or --device_map cuda=cpu for the others")
    v = r["versions"]
    lines.append("versions: " + ", ".join(f"{n} {v[n] or 'not installed'}" for n in v))
    lines.append(_cache_line("tokenizer cache", "KT_CACHE_DIR", r["caches"]["tokenizers"]))
    lines.append(_cache_line("packed-weight cache", "KT_PACKED_CACHE", r["caches"]["packed_experts"]))
    lines += [f"problem: {p}" for p in problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktransformers.doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report, problems = collect()
    if args.json:
        print(json.dumps({**report, "problems": problems}, indent=2))
    else:
        print(format_report(report, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
