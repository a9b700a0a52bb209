"""The closest known dotted key to a mistyped one, for the `did you mean` of an unknown-key error."""

from __future__ import annotations

import difflib
from collections.abc import Collection


def closest_key(key: str, paths: Collection[str]) -> str | None:
    """The key of `paths` (dotted leaves) that `key` most likely meant, or None when none is close.

    A last part that exists elsewhere (a key under the wrong group) gives the path ending in it that reads most like
    `key`; otherwise each part that is not a child of the parts before it is replaced by its closest sibling."""
    last = key.rsplit(".", 1)[-1]
    moved = [p for p in paths if p.rsplit(".", 1)[-1] == last and p != key]
    if moved:
        return max(moved, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    children: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            children.setdefault(".".join(parts[:i]), set()).add(part)
    prefix = ""
    for part in key.split("."):
        names = children.get(prefix)
        if not names:  # `key` goes on below a leaf
            return None
        if part not in names:
            match = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            if not match:
                return None
            part = match[0]
        prefix = f"{prefix}.{part}" if prefix else part
    return prefix if prefix != key else None
