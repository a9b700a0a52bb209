"""What the parent and child sides of a FunctionPool share: the form of a target, JSON as it crosses the pipes, the
limits on what crosses, one-line errors.

Standard library only, and numpy is never imported here: the children import this module and should start fast.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from shardrl.errors import UserError

MAX_LINE = 1 << 20  # bytes: a longer line from a child is refused, so it cannot grow the parent's memory without bound
MAX_ERROR = 500  # characters kept of an error message


class LoadError(UserError, ValueError):
    """The user's function cannot be loaded (bad target, import error, not callable): one line naming the target."""


def is_file_target(where: str) -> bool:
    """Whether the part of a target before its ':' names a file rather than a module."""
    return where.endswith(".py") or "/" in where


def resolve_target(target: str, base_dir: str | None, label: str) -> str:
    """The target with its file (if it names one) made absolute, so the children need no base_dir."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise LoadError(f"{label} function {target!r} must read 'package.module:function' or "
                        f"'path/to/file.py:function'")
    if is_file_target(where):
        where = os.path.abspath(os.path.join(base_dir or os.getcwd(), where))
    return f"{where}:{name}"


def encode(message: Any) -> bytes:
    """One protocol line; a TypeError for what JSON cannot carry (numpy values become plain JSON)."""
    return json.dumps(message, default=to_json, separators=(",", ":")).encode() + b"\n"


def to_json(value: Any) -> Any:
    """json.dumps's fallback: numpy arrays and scalars (parquet rows hold them) as lists and Python numbers."""
    numpy = sys.modules.get("numpy")  # loaded wherever such values exist; never imported here
    if numpy is not None and isinstance(value, numpy.ndarray):
        return value.tolist()
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    raise TypeError(f"a call cannot carry a {type(value).__name__}: only JSON values and numpy arrays")


def is_finite_number(value: Any) -> bool:
    """An int or float (as JSON decodes numbers) that is finite; bools are no numbers here."""
    if type(value) is int:
        return abs(value) <= sys.float_info.max  # float(value) would overflow past it
    return type(value) is float and math.isfinite(value)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_ERROR]


def describe(exc: BaseException) -> str:
    """An exception as one line: "<ExceptionType>: <message>"."""
    return one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

