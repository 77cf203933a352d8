import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# KT_TEST_QUICK=1 (used by the KT_ISA subprocess runs) shrinks the parameter grid.
QUICK = os.environ.get("KT_TEST_QUICK") == "1"
