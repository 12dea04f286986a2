"""The spec room's errors: an invalid job spec (every problem, each with its field), and
unusable data.

:class:`JobSpecError` carries a list of :class:`FieldError`; validation collects them in a
:class:`Problems` list, so one error can name every problem in the spec at once.
"""

from __future__ import annotations

import errno
import reprlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HOST_OUT_OF_RESOURCES",
    "MAX_LISTED_PROBLEMS",
    "DataError",
    "FieldError",
    "JobSpecError",
    "Problems",
    "host_shortage",
    "show_value",
]


@dataclass(frozen=True)
class FieldError:
    """One problem in a spec: where, what was given, what was expected."""

    path: str
    """Dotted field path, e.g. ``optimizer.lr`` (``""`` for the spec as a whole)."""
    message: str
    """Complete human-readable sentence(s), including the given value."""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


MAX_LISTED_PROBLEMS = 50
"""Problems a JobSpecError's message lists; the rest are counted (``errors`` has all)."""


class JobSpecError(ValueError):
    """A job spec is invalid. ``errors`` lists every problem found, not just the first;
    the message lists the first MAX_LISTED_PROBLEMS and counts the rest."""

    def __init__(self, errors: list[FieldError], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.errors)
        lines = [f"invalid job spec{where} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {_clip(str(e))}" for e in self.errors[:MAX_LISTED_PROBLEMS]]
        if n > MAX_LISTED_PROBLEMS:
            lines.append(f"  ... and {n - MAX_LISTED_PROBLEMS} more problems not shown")
        super().__init__("\n".join(lines))


def _clip(text: str, limit: int = 800) -> str:
    # One problem's line: a key of a megabyte must not make a megabyte message. The
    # middle goes: a line ends with what to do about it ("... with --allow-read DIR"),
    # which long paths before it must not push out.
    if len(text) <= limit:
        return text
    tail = limit // 4
    head = limit - tail
    return f"{text[:head]} ... ({len(text) - limit} characters left out) ... {text[-tail:]}"


class Problems:
    """Collects problems during one validation pass."""

    def __init__(self) -> None:
        self.items: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(FieldError(path, message))

    def bad(self, path: str, given: Any, expected: str) -> None:
        self.add(path, f"got {show_value(given)}; expected {expected}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def show_value(value: Any) -> str:
    """A given value for a message: short, with its type (``'3e-3' (str)``)."""
    # Tuples only exist after normalisation; the user wrote a list. reprlib, not repr: a
    # value of shared sublists (YAML aliases) can be exponentially long when written out.
    text = _REPR.repr(list(value)) if isinstance(value, tuple) else _REPR.repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = "list" if isinstance(value, tuple) else type(value).__name__
    return f"{text} ({kind})"


class DataError(ValueError):
    """A data file, tokenizer or data cursor is unusable. The message names the path
    (and the line number, for a bad JSONL line)."""


HOST_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
"""Errors reading a spec's files that say the coordinator's host ran out of descriptors
or memory (a flood of connections?), not that the spec or its files are wrong: they
propagate as OSError, so a running job pauses to be resumed instead of failing for good
(the job runner's rule)."""


def host_shortage(exc: BaseException) -> OSError | None:
    """The OSError in ``exc``'s chain (itself, then what it was raised from or during)
    whose errno is one of HOST_OUT_OF_RESOURCES, or None. Libraries such as
    transformers wrap the OSError of a file they could not open in errors of their own."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in HOST_OUT_OF_RESOURCES:
            return current
        current = current.__cause__ or current.__context__
    return None
