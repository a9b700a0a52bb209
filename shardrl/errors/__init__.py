"""The one type of user-caused failure, below every floor so that each can raise it.

A `UserError` is something the user can fix: a config key, a file, a function of theirs, a sample of their data.
Its message is one line that names that first, then says what is wrong and what to do. The entry point
(`trainer.main_ppo`) prints it as ``error: <message>`` and exits 2, also when a worker raised it; a traceback is
printed only with ``SHARDRL_DEBUG=1``. Each floor's own error types derive from it where their cause is the
user's, beside the built-in exception they always derived from (callers' `except ValueError` keep working).
"""

from __future__ import annotations

DEBUG_ENV = "SHARDRL_DEBUG"  # set to 1: the entry point prints tracebacks as well


class UserError(Exception):
    """A failure the user can fix; `str(err)` is one line naming the key, file or function first."""


def first_line(err: BaseException) -> str:
    """The first non-blank line of `err`'s message (its type's name when it has none): a one-line error from an
    exception of someone else's whose message may span lines."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
