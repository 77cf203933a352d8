"""NUMA nodes and their CPUs, read from Linux sysfs, for thread pools pinned to one node.

On a machine with several memory nodes, a pool whose threads run on one node's cores reads that
node's DRAM at local bandwidth; threads spread over all nodes pay the remote hops on every decode
step.  ``CPUInfer(numa_node=n)`` (``pool.py``) pins its threads to the CPUs this module finds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: where Linux lists the NUMA nodes (``nodeN/cpulist``)
NODE_ROOT = Path("/sys/devices/system/node")
#: CPU numbers past this are refused (a corrupt list must not allocate a range of billions)
MAX_CPUS = 1 << 16

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_NODE_DIR = re.compile(r"node([0-9]+)")


def parse_cpulist(text: str, where: str = "cpulist") -> tuple[int, ...]:
    """The CPUs of a kernel list (``"0-3,8-11"``, the format of sysfs ``cpulist`` files), sorted.

    An empty list (a node with memory but no CPUs) gives ``()``; anything else that is not
    comma-separated numbers and ranges raises ``ValueError`` naming ``where``.
    """
    if not isinstance(text, str):
        raise TypeError(f"{where}: expected a str, got {type(text).__name__}")
    text = text.strip()
    if not text:
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise ValueError(f"{where}: {part!r} is not a CPU number or range (expected a list like '0-3,8-11')")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"{where}: range {part!r} runs backwards")
        if hi >= MAX_CPUS:
            raise ValueError(f"{where}: CPU {hi} in {part!r} is past the largest CPU number taken ({MAX_CPUS - 1})")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def numa_nodes(root: str | os.PathLike | None = None) -> dict[int, tuple[int, ...]]:
    """Node number -> its CPUs, for every ``nodeN`` directory under ``root`` (default
    :data:`NODE_ROOT`); ``{}`` where there is
    none (no NUMA information: not Linux, or a container without sysfs).  A ``cpulist`` that does not
    parse raises ``ValueError`` naming the file."""
    nodes: dict[int, tuple[int, ...]] = {}
    root = Path(NODE_ROOT if root is None else root)
    if not root.is_dir():
        return nodes
    for d in root.iterdir():
        m = _NODE_DIR.fullmatch(d.name)
        if m is None:
            continue
        f = d / "cpulist"
        try:
            text = f.read_text()
        except OSError:
            continue  # not a node with a CPU list (sysfs lists one for each node)
        nodes[int(m.group(1))] = parse_cpulist(text, str(f))
    return dict(sorted(nodes.items()))


def node_cpus(node: int, root: str | os.PathLike | None = None) -> tuple[int, ...]:
    """The CPUs of NUMA node ``node`` that this thread may run on (its affinity mask, so a cgroup's
    cpuset is respected); ``ValueError`` naming the node when it does not exist or has none."""
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"numa_node: expected a non-negative int, got {node!r}")
    nodes = numa_nodes(root)
    if node not in nodes:
        have = ", ".join(map(str, nodes)) if nodes else f"none listed under {NODE_ROOT if root is None else root}"
        raise ValueError(f"numa_node: node {node} does not exist (nodes: {have})")
    allowed = os.sched_getaffinity(0)
    cpus = tuple(c for c in nodes[node] if c in allowed)
    if not cpus:
        raise ValueError(f"numa_node: node {node} has no CPU this process may run on (node CPUs: "
                         f"{format_cpulist(nodes[node]) or 'none'}; allowed: {format_cpulist(allowed)})")
    return cpus


def format_cpulist(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the inverse of :func:`parse_cpulist`)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
