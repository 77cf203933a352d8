"""``python -m ktransformers.convert``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
