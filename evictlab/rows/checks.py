"""Coercion and checks of user arrays handed to the row writer and reader.

Each raises :class:`~evictlab.errors.InputError` naming the argument (and entry) at fault.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evictlab.errors import InputError


def int_array(x: Any, field_name: str, length: int | None = None, lo: int | None = None) -> np.ndarray:
    """Coerce ``x`` to a 1-D int64 array, checking length and lower bound."""
    arr = np.asarray(x)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(field_name, f"must be a 1-D integer array, got dtype {arr.dtype} "
                         f"shape {arr.shape}", "pass integer ids/positions")
    arr = arr.astype(np.int64)
    if length is not None and arr.shape[0] != length:
        raise InputError(field_name, f"has length {arr.shape[0]}, expected {length}",
                         "pass one entry per row")
    if lo is not None and arr.size and int(arr.min()) < lo:
        raise InputError(field_name, f"has value {int(arr.min())} < {lo}",
                         f"use values >= {lo}")
    return arr


def float_matrix(x: Any, field_name: str, d: int, rows: int | None = None) -> np.ndarray:
    """Coerce ``x`` to a float32 ``[R, d]`` array with only finite entries."""
    arr = np.asarray(x)
    if arr.ndim != 2 or arr.shape[1] != d or not np.issubdtype(arr.dtype, np.number):
        raise InputError(field_name, f"has shape {arr.shape} (dtype {arr.dtype}), expected "
                         f"[{'R' if rows is None else rows}, {d}] numbers",
                         f"pass a 2-D float array with head_dim={d} columns")
    if rows is not None and arr.shape[0] != rows:
        raise InputError(field_name, f"has {arr.shape[0]} rows, expected {rows}",
                         "pass one vector per entry")
    bad = ~np.isfinite(arr).all(axis=1)
    if bad.any():
        raise InputError(f"{field_name}[{int(np.argmax(bad))}]", "contains NaN or inf",
                         "drop or fix that row before writing")
    return arr.astype(np.float32)


_FACT_INTS = ("start", "end", "key_start", "key_end", "value_start", "value_end")


def check_facts(facts: Any, n_tokens: int) -> list[dict[str, Any]] | None:
    """Check a prompt's fact labels (``RowWriter.add_prompt(facts=...)``); return them typed.

    ``facts``: None (an unlabelled prompt) or a sequence of mappings with the fields of
    :data:`evictlab.rows.schema.FACT_STRUCT`. Each fact must lie inside the prompt's
    ``n_tokens`` tokens (``0 <= start < end <= n_tokens``), facts must be in order and must
    not overlap (``end_i <= start_{i+1}``), a key or value span is ``(-1, -1)`` or a
    non-empty span inside its fact, ``kind`` one of :data:`~evictlab.rows.schema.FACT_KINDS`
    and ``asked`` a bool. Anything else is an :class:`InputError` naming ``facts[i]``.
    """
    from evictlab.rows.schema import FACT_KINDS, FACT_STRUCT

    if facts is None:
        return None
    if isinstance(facts, (str, bytes)) or not hasattr(facts, "__len__"):
        raise InputError("facts", f"must be None or a list of facts, got {type(facts).__name__}",
                         "pass one dict per fact (kind, start, end, key_start, key_end, value_start, value_end, asked)")
    out: list[dict[str, Any]] = []
    fields = set(FACT_STRUCT.to_schema())
    for i, f in enumerate(facts):
        name = f"facts[{i}]"
        if not isinstance(f, dict) or set(f) != fields:
            got = sorted(f) if isinstance(f, dict) else type(f).__name__
            raise InputError(name, f"must have exactly the fields {sorted(fields)}, got {got}",
                             "build facts with evictlab.tasks.synthetic.fact_token_spans")
        if f["kind"] not in FACT_KINDS:
            raise InputError(name, f"kind {f['kind']!r} is not one of {FACT_KINDS}", "use one of those kinds")
        if not isinstance(f["asked"], (bool, np.bool_)):
            raise InputError(name, f"asked must be true or false, got {f['asked']!r}", "pass a bool")
        vals = {}
        for k in _FACT_INTS:
            v = f[k]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise InputError(name, f"{k} must be an integer, got {v!r}", "pass token positions as ints")
            vals[k] = int(v)
        a, b = vals["start"], vals["end"]
        if not 0 <= a < b <= n_tokens:
            raise InputError(name, f"span [{a}, {b}) lies outside the prompt's {n_tokens} tokens or is empty",
                             f"use 0 <= start < end <= {n_tokens}")
        for part in ("key", "value"):
            lo, hi = vals[f"{part}_start"], vals[f"{part}_end"]
            if (lo, hi) != (-1, -1) and not a <= lo < hi <= b:
                raise InputError(name, f"{part} span [{lo}, {hi}) is not a non-empty span inside the fact [{a}, {b})",
                                 f"use ({part}_start, {part}_end) = (-1, -1) or a span inside the fact")
        if out and a < out[-1]["end"]:
            raise InputError(name, f"span [{a}, {b}) overlaps or precedes the previous fact "
                             f"[{out[-1]['start']}, {out[-1]['end']})", "list facts in order, without overlaps")
        out.append({"kind": str(f["kind"]), **vals, "asked": bool(f["asked"])})
    return out
