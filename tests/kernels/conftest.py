import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# KT_TEST_QUICK=1 (used by the KT_ISA subprocess runs) shrinks the parameter grid.
QUICK = os.environ.get("KT_TEST_QUICK") == "1"

# ISA tiers, lowest first (csrc/cpu_features.h IsaTier); those this CPU runs: cpuinfer_ext.supported_isa_tiers().
TIERS = ["scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16", "amx"]


def int_kernel_suffix(tier: str) -> str:
    """Suffix of the 256-bit integer kernels' names: the avxvnni tier runs them with vpdpbusd."""
    return "_vnni256" if tier == "avxvnni" else "_avx2"
