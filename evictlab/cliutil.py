"""The command line's rules for option values, shared by every command (docs/architecture.md,
"CLI conventions").

* **Lists** (:func:`parse_list`, :func:`parse_ints`): an option that takes several values
  takes them comma-separated (``--methods snapkv,h2o``), repeated (``--budget 64 --budget
  128``) or both; items are stripped of spaces. An empty entry (``--methods snapkv,``,
  ``--budgets 4,,8``) and a value given twice (``--methods h2o,h2o``) are refused with one
  line naming the option and the entry, never dropped or merged silently. A comma inside
  square brackets does not split (:func:`split_outside_brackets`): a method's own parameters,
  ``--methods "snapkv[window=32,kernel=7],h2o"`` is two methods.
* **Options that apply only with another** (:func:`refuse_unused`): given on the command
  line where the other option makes them meaningless (``rows synth --clusters 3`` without
  ``--values clustered``), they are refused, never ignored.
* **Finished outputs** (:func:`outputs_written`): a command calls it once its outputs are
  complete on disk; an interrupt after that point (Ctrl-C while the summary prints) no
  longer reports the run as interrupted: it exits 0 with one note (:mod:`evictlab.cli`).

* **Config files** (:func:`read_config`, :func:`apply_config`): a command that takes
  ``--config FILE.toml`` reads its keys (an option's name without its dashes,
  ``--compress-every`` -> ``compress_every``) as values of those options; an option given on
  the command line overrides the file; an unknown key is refused, naming it and the valid
  ones. The file's path, SHA-256 and keys go into the run record (:meth:`ConfigFile.record`).

* **One vocabulary** (docs/architecture.md, "CLI conventions"): ``--budget`` is always a KV
  budget text, ``--keep`` the keys kept per attention row, ``--protocol`` the protocol,
  ``--store`` how the KV cache is held, ``--quiet`` (:data:`QUIET`) silences progress. Option
  spellings renamed to it (:data:`RENAMED`) keep working for one release: the entry point
  rewrites them (:func:`renamed_options`) and prints one ``note:`` line each on stderr.

Errors are :class:`~evictlab.errors.InputError` naming the option (exit code 2 through the CLI).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from evictlab.errors import InputError, refuse_duplicates

__all__ = ["CONFIG_KINDS", "QUIET", "RENAMED", "ConfigFile", "apply_config", "given", "outputs_written", "parse_ints",
           "parse_list", "read_config", "refuse_unused", "renamed_options", "split_outside_brackets", "written_outputs"]

#: Outputs the running command has declared complete (:func:`outputs_written`).
_WRITTEN: list[str] = []


def split_outside_brackets(text: str, sep: str) -> list[str]:
    """``text`` split at every ``sep`` that is not inside square brackets (not stripped):
    ``"a[x=1,y=2],b"`` -> ``["a[x=1,y=2]", "b"]``. A bracket left open keeps the rest in one
    piece (the method parser refuses it, naming the option); a ``]`` with no ``[`` counts as
    outside. One rule for list entries (:func:`parse_list`) and the parts of a method text
    (:func:`evictlab.methods.registry.parse_method_text`)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def parse_list(values: str | Sequence[str] | None, option: str, what: str = "entry", *,
               key: Callable[[str], Any] | None = None) -> list[str]:
    """The entries of a list option: ``"a, b,c"`` or ``["a", "b,c"]`` -> ``["a", "b", "c"]``;
    commas inside ``[...]`` do not split (:func:`split_outside_brackets`: a method's parameters).

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
        parts = [p.strip() for p in split_outside_brackets(str(item), ",")]
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


#: What a config file's key may hold: ``list`` (a TOML array of strings or numbers, or a
#: comma-separated string: the option's text, as on the command line), ``strings`` (a string
#: or an array of strings: a repeatable option), ``int``, ``str``, ``bool``, ``path``.
CONFIG_KINDS = ("list", "strings", "int", "str", "bool", "path")


@dataclass(frozen=True)
class ConfigFile:
    """A config file as read by :func:`read_config`: its ``path`` (as given), the SHA-256 of
    its bytes, ``values`` (key -> value converted to what the option takes) and ``table``
    (key -> value as written)."""

    path: str
    sha256: str
    values: dict[str, Any]
    table: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """What a run record keeps of it: the path, its SHA-256 and the keys as written."""
        return {"path": self.path, "sha256": self.sha256, "keys": dict(self.table)}


def _config_value(value: Any, kind: str, key: str, path: Path, option: str) -> Any:
    def bad(what: str) -> InputError:
        return InputError(option, f"{key} in {path} is {value!r}, not {what}", f"write {key} as {what}")

    if kind == "list":
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                     for v in value):
            return ",".join(str(v) for v in value)
        raise bad("a list of values (e.g. [\"a\", \"b\"]) or a comma-separated string")
    if kind == "strings":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad("a string or a list of strings")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad("a whole number")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if kind in ("str", "path"):
        if isinstance(value, str):
            return Path(value) if kind == "path" else value
        raise bad("a string")
    raise ValueError(f"unknown config kind {kind!r}")


def read_config(path: str | Path, keys: Mapping[str, str], option: str = "--config") -> ConfigFile:
    """Read the TOML file ``path`` whose keys may be those of ``keys`` (key -> one of
    :data:`CONFIG_KINDS`), each value checked and converted (see :data:`CONFIG_KINDS`).
    :class:`InputError` on ``option``: no such file, not TOML, an unknown key (naming it
    and the valid ones), a value of the wrong kind (naming the key)."""
    import hashlib
    import tomllib

    p = Path(path)
    if not p.is_file():
        raise InputError(option, f"{p} is not a file", "pass a TOML config file, e.g. experiments/smoke.toml")
    data = p.read_bytes()
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InputError(option, f"{p} is not a TOML file ({exc})", "fix the file's syntax (key = value lines)") from None
    unknown = [k for k in table if k not in keys]
    if unknown:
        raise InputError(option, f"unknown key {unknown[0]!r} in {p}", f"use some of: {', '.join(keys)}")
    values = {k: _config_value(v, keys[k], k, p, option) for k, v in table.items()}
    return ConfigFile(str(p), hashlib.sha256(data).hexdigest(), values, table)


def apply_config(ctx: Any, params: dict[str, Any], config: ConfigFile | None,
                 names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``params`` (a command's parameter values, by Python name) with every key of ``config``
    applied where its option was not given on the command line (:func:`given`): the command
    line overrides the file. ``names`` maps a key to its parameter's name where they differ
    (``budget`` -> ``budgets``)."""
    out = dict(params)
    if config is None:
        return out
    names = names or {}
    for key, value in config.values.items():
        param = names.get(key, key)
        if not given(ctx, param):
            out[param] = value
    return out


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
