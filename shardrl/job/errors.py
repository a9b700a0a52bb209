"""The one error type of the job description: a user's config (or a file it names) that cannot run."""

from __future__ import annotations

from shardrl.errors import UserError


class ConfigError(UserError, ValueError):
    """An invalid config; `str(err)` is one line: ``<dotted.key>: <reason>``."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason
