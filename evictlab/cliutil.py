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

* **One vocabulary** (docs/architecture.md, "CLI conventions"): ``--budget`` is always a KV
  budget text, ``--keep`` the keys kept per attention row, ``--protocol`` the protocol,
  ``--store`` how the KV cache is held, ``--quiet`` (:data:`QUIET`) silences progress. Option
  spellings renamed to it (:data:`RENAMED`) keep working for one release: the entry point
  rewrites them (:func:`renamed_options`) and prints one ``note:`` line each on stderr.

Errors are :class:`~evictlab.errors.InputError` naming the option (exit code 2 through the CLI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import typer

from evictlab.errors import InputError, refuse_duplicates

__all__ = ["QUIET", "RENAMED", "outputs_written", "parse_ints", "parse_list", "refuse_unused", "renamed_options",
           "written_outputs"]

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


# --------------------------------------------------------------------------------------
# One vocabulary: renamed spellings, --quiet
# --------------------------------------------------------------------------------------

#: Options renamed to the one vocabulary in this release, per command (its words after
#: ``evictlab``): old spelling -> the tokens that replace it (an old flag may become an option
#: with its value: ``--query-aware`` -> ``--protocol query-aware``). The old spellings work
#: until the next release, each with one ``note:`` line on stderr; then this table goes.
RENAMED: dict[str, dict[str, tuple[str, ...]]] = {
    "solve": {"--budgets": ("--keep",)},
    "demo": {"--budgets": ("--keep",)},
    "dilution check": {"--budgets": ("--keep",)},
    "capture": {"--mode": ("--protocol",)},
    "decode": {"--mode": ("--store",), "--query-aware": ("--protocol", "query-aware")},
    "audit": {"--query-aware": ("--protocol", "query-aware")},
    "eval run": {"--budgets": ("--budget",), "--modes": ("--store",), "--protocols": ("--protocol",)},
    "rows synth": {"--rows": ("--count",)},
}


def renamed_options(command: str, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` (after the command's words) with every old spelling of :data:`RENAMED` for
    ``command`` replaced, and one note per old spelling used. ``--old=VALUE`` becomes
    ``--new=VALUE``; nothing after a ``--`` is touched."""
    table = RENAMED.get(command, {})
    out: list[str] = []
    used: list[str] = []
    for i, tok in enumerate(args):
        if tok == "--":
            out += list(args[i:])
            break
        name, eq, value = tok.partition("=")
        new = table.get(name)
        if new is None:
            out.append(tok)
            continue
        if name not in used:
            used.append(name)
        out += [f"{new[0]}={value}"] if eq and len(new) == 1 else list(new)
    notes = [f"note: `evictlab {command} {old}` is now {' '.join(table[old])}; the old spelling works in this "
             "release only" for old in used]
    return out, notes


#: The ``--quiet`` option of every long command (one declaration, one help text): no progress
#: bars or progress lines on stderr; results, warnings and errors still print.
QUIET: Any = typer.Option(False, "--quiet", help="no progress bar or progress lines on stderr (results, warnings "
                          "and errors still print)")
