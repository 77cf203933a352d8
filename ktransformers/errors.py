"""Errors a user can act on.  Each carries one line that names the thing at fault.

Command-line entry points catch ``KTError`` and print ``error: <message>`` with exit code 2
instead of a traceback.
"""

from __future__ import annotations


class KTError(Exception):
    """Base class: the message is one self-contained line for the user."""


class RuleError(KTError):
    """A rule file is invalid, or a rule does not fit the model it is applied to."""


class WeightError(KTError):
    """A weight file is unreadable, or lacks / disagrees about a tensor."""


class ConfigError(KTError):
    """Bad command-line or configuration input (paths, architectures, flags)."""
