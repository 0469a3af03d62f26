"""The command line's rules for option values, shared by every command (docs/architecture.md,
"CLI conventions").

* **Lists** (:func:`parse_list`, :func:`parse_ints`): an option that takes several values
  takes them comma-separated (``--methods snapkv,h2o``), repeated (``--budget 64 --budget
  128``) or both; items are stripped of spaces. An empty entry (``--methods snapkv,``,
  ``--budgets 4,,8``) and a value given twice (``--methods h2o,h2o``) are refused with one
  line naming the option and the entry, never dropped or merged silently.
* **Options that apply only with another** (:func:`refuse_unused`): given on the command
  line where the other option makes them meaningless (``rows synth --clusters 3`` without
  ``--values clustered``), they are refused, never ignored.
* **Finished outputs** (:func:`outputs_written`): a command calls it once its outputs are
  complete on disk; an interrupt after that point (Ctrl-C while the summary prints) no
  longer reports the run as interrupted: it exits 0 with one note (:mod:`evictlab.cli`).

Errors are :class:`~evictlab.errors.InputError` naming the option (exit code 2 through the CLI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from evictlab.errors import InputError, refuse_duplicates

__all__ = ["outputs_written", "parse_ints", "parse_list", "refuse_unused", "written_outputs"]

#: Outputs the running command has declared complete (:func:`outputs_written`).
_WRITTEN: list[str] = []


def parse_list(values: str | Sequence[str] | None, option: str, what: str = "entry", *,
               key: Callable[[str], Any] | None = None) -> list[str]:
    """The entries of a list option: ``"a, b,c"`` or ``["a", "b,c"]`` -> ``["a", "b", "c"]``.

    ``None`` (the option not given) -> ``[]``. An empty entry (``"a,,b"``, ``"a,"``, ``""``) or
    an entry given twice is an :class:`InputError` on ``option`` naming it (``what`` is the
    word for one entry: ``"method"``, ``"budget"``). ``key`` maps an entry to what counts as
    the same entry (e.g. a canonical form), default the entry itself.
    """
    if values is None:
        return []
    raw = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in raw:
        parts = [p.strip() for p in str(item).split(",")]
        if any(not p for p in parts):
            shown = ",".join(str(r) for r in raw)
            problem = "is empty" if not shown.strip() else f"{shown!r} has an empty entry"
            raise InputError(option, problem, f"give comma-separated {what}s without empty entries "
                             "(no leading, trailing or doubled comma)")
        out += parts
    refuse_duplicates([key(x) for x in out] if key else out, option, what)
    return out


def parse_ints(values: str | Sequence[str] | None, option: str, what: str = "value", *,
               lo: int | None = None, example: str = "4,8,16") -> list[int]:
    """:func:`parse_list` of whole numbers (``lo``: the smallest allowed); a duplicate is
    the same number (``8`` and ``08``)."""
    out: list[int] = []
    for part in parse_list(values, option, what):
        try:
            v = int(part)
        except ValueError:
            raise InputError(option, f"{part!r} is not a whole number",
                             f"pass comma-separated integers, e.g. {example}") from None
        if lo is not None and v < lo:
            raise InputError(option, f"{what} {v} is below {lo}", f"pass {what}s >= {lo}, e.g. {example}")
        out.append(v)
    refuse_duplicates(out, option, what)
    return out


def given(ctx: Any, param: str) -> bool:
    """Whether the parameter ``param`` (its Python name) was set on the command line or in the
    environment rather than left at its default (click's parameter source)."""
    src = ctx.get_parameter_source(param) if ctx is not None else None
    return getattr(src, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def refuse_unused(ctx: Any, param: str, option: str, applies: bool, needs: str) -> None:
    """Refuse ``option`` (parameter ``param`` of the command whose click context is ``ctx``)
    when it was given but does not apply (``applies`` False); ``needs`` says what it needs,
    e.g. ``"--values clustered"``."""
    if not applies and given(ctx, param):
        raise InputError(option, f"only applies with {needs}", f"drop {option}, or pass {needs}")


def outputs_written(*paths: Any) -> None:
    """Declare the running command's outputs ``paths`` complete on disk (its last write
    done): an interrupt from here on exits 0 (the outputs are there), not 130."""
    _WRITTEN.extend(str(p) for p in paths)


def written_outputs(reset: bool = False) -> list[str]:
    """The outputs declared by :func:`outputs_written` (``reset``: forget them, at the start
    of a command)."""
    out = list(_WRITTEN)
    if reset:
        _WRITTEN.clear()
    return out
