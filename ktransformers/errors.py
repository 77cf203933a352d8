"""Errors a user can act on.  Each carries one line that names the thing at fault.

Command-line entry points catch ``KTError`` and print ``error: <message>`` with exit code 2
instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Callable


class KTError(Exception):
    """Base class: the message is one self-contained line for the user."""


class RuleError(KTError):
    """A rule file is invalid, or a rule does not fit the model it is applied to."""


class WeightError(KTError):
    """A weight file is unreadable, or lacks / disagrees about a tensor."""


class ConfigError(KTError):
    """Bad command-line or configuration input (paths, architectures, flags)."""


def run_command(body: Callable[[], int]) -> int:
    """A command-line entry point's exit code: ``body()``'s, 2 with the one ``error: <message>``
    line for a :class:`KTError`, 130 for Ctrl-C (no traceback either way)."""
    try:
        return body()
    except KTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
