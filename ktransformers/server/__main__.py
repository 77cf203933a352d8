"""``python -m ktransformers.server``: same as the ``ktransformers`` console script."""

from .main import main

raise SystemExit(main())
