"""Errors that name the offending field and say how to fix it.

Every check on user input raises :class:`InputError` (a ``ValueError``) with three parts:
the field (``"p[3]"``, ``"--keep"``, ``"index.parquet"``), what is wrong, and the fix.
The CLI prints the message without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class EvictlabError(Exception):
    """Base class for every error evictlab raises on purpose."""


class InputError(EvictlabError, ValueError):
    """Bad user input: names the field, the problem and the fix."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # pickled with its three parts (a Ray worker's error reaches the driver intact)
        return (type(self), (self.field, self.problem, self.fix))


class CorruptFileError(InputError):
    """A file on disk is truncated, corrupt or of an unknown schema version."""


class BudgetExceededError(EvictlabError, RuntimeError):
    """A KV store was asked to hold more than its budget (never grows silently)."""


def refuse_duplicates(items: Iterable[object], field: str, what: str) -> None:
    """:class:`InputError` on ``field`` naming the first item of ``items`` given twice."""
    seen: set[object] = set()
    for x in items:
        if x in seen:
            raise InputError(field, f"{what} {x} is given twice", f"give each {what} once")
        seen.add(x)
