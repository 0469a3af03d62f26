"""Input checks for the single-row core: every bad row or batch raises :class:`InputError`.

The checks are vectorised numpy (linear in the input size, no Python loop over keys), so
the public wrappers in :mod:`evictlab.core.kernels` can afford to run them on every call.
The jitted kernels themselves never validate.

Conventions checked here (see ``docs/theory.md``):

* masses ``p`` are finite, non-negative and sum to 1 within ``MASS_TOL`` (absolute), per row;
* values are finite with ``|v| <= VALUE_MAX``, float64 after conversion, shape ``(n, d)``
  with ``n >= 1``, ``d >= 1``;
* a kept set is a non-empty set of distinct integer key indices in ``[0, n)``;
* a budget ``s`` satisfies ``1 <= s <= n``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from evictlab.errors import InputError

#: Largest allowed ``|sum(p) - 1|`` for one row (float32 softmax rows sit well inside it).
MASS_TOL = 1e-6
#: Largest allowed ``|value|``: the free-weight solver squares norms, which must stay finite.
VALUE_MAX = 1e100


class Batch(NamedTuple):
    """A validated ragged batch, converted to contiguous float64 / int64 arrays.

    ``p`` float64 ``[sum n_i]``, ``p_off`` int64 ``[N+1]``, ``values`` float64 ``[K, d]``,
    ``v_start`` int64 ``[N]`` (layout in ``docs/architecture.md``).
    """

    p: np.ndarray
    p_off: np.ndarray
    values: np.ndarray
    v_start: np.ndarray


def _as_float_array(x: object, field: str, ndim: int) -> np.ndarray:
    """Convert to a C-contiguous float64 array of the given ndim, or raise InputError."""
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise InputError(field, f"cannot be read as an array ({exc})", f"pass a {ndim}-D float array") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise InputError(field, f"has dtype {arr.dtype}, not a real number type", f"pass a {ndim}-D float array")
    if arr.ndim != ndim:
        raise InputError(field, f"has {arr.ndim} dimensions, shape {arr.shape}", f"pass a {ndim}-D array")
    return np.ascontiguousarray(arr, dtype=np.float64)


def _as_int_array(x: object, field: str, ndim: int) -> np.ndarray:
    """Convert to a C-contiguous int64 array of the given ndim, or raise InputError.

    Floats are accepted only when they hold exact integers (e.g. a list read from JSON).
    """
    try:
        arr = np.asarray(x)
    except Exception as exc:
        raise InputError(field, f"cannot be read as an array ({exc})", f"pass a {ndim}-D integer array") from None
    if arr.ndim != ndim:
        raise InputError(field, f"has {arr.ndim} dimensions, shape {arr.shape}", f"pass a {ndim}-D integer array")
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64)
    if np.issubdtype(arr.dtype, np.integer):
        return np.ascontiguousarray(arr, dtype=np.int64)
    if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        return np.ascontiguousarray(arr, dtype=np.int64)
    raise InputError(field, f"has dtype {arr.dtype} with non-integer entries", "pass integer indices (int64)")


def _first_bad(mask: np.ndarray) -> tuple[int, ...]:
    """Index tuple of the first True entry of ``mask`` (for naming it in an error)."""
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _check_masses(p: np.ndarray, field: str) -> None:
    """Finite and non-negative masses, naming the first offending entry."""
    bad = ~np.isfinite(p)
    if bad.any():
        (i,) = _first_bad(bad)
        raise InputError(f"{field}[{i}]", f"is {p[i]!r}, not finite", "remove NaN/inf masses (recompute the softmax in float64)")
    neg = p < 0
    if neg.any():
        (i,) = _first_bad(neg)
        raise InputError(f"{field}[{i}]", f"is negative ({p[i]!r})", "attention masses must be >= 0 (pass softmax outputs)")


def _check_values(values: np.ndarray, field: str) -> None:
    """Finite values with at least one dimension, naming the first offending entry."""
    if values.shape[1] < 1:
        raise InputError(field, f"has shape {values.shape}: zero value dimensions", "pass values of shape (n, d) with d >= 1")
    bad = ~np.isfinite(values)
    if bad.any():
        i, j = _first_bad(bad)
        raise InputError(f"{field}[{i}, {j}]", f"is {values[i, j]!r}, not finite", "remove NaN/inf value vectors")
    huge = np.abs(values) > VALUE_MAX
    if huge.any():
        i, j = _first_bad(huge)
        raise InputError(
            f"{field}[{i}, {j}]", f"is {values[i, j]!r}, beyond +-{VALUE_MAX:g} (squared norms would overflow float64)",
            "rescale the values (every error scales linearly with them)",
        )


def validate_masses(p: object, field: str = "p") -> np.ndarray:
    """Check one row's masses ``(n,)`` (finite, >= 0, n >= 1, sum 1 within ``MASS_TOL``).

    Returns:
        ``p`` as a C-contiguous float64 array (not renormalised).
    """
    p_arr = _as_float_array(p, field, 1)
    if p_arr.shape[0] == 0:
        raise InputError(field, "is empty (a row needs at least one key)", "pass a row with n >= 1 keys")
    _check_masses(p_arr, field)
    total = float(p_arr.sum())
    if abs(total - 1.0) > MASS_TOL:
        raise InputError(field, f"sums to {total!r}, not 1 within {MASS_TOL:g}", "normalise p (p / p.sum()) or pass softmax outputs")
    return p_arr


def validate_row(p: object, values: object, field: str = "row") -> tuple[np.ndarray, np.ndarray]:
    """Check one attention row and return it as float64 arrays.

    Args:
        p: attention masses, shape ``(n,)``; finite, >= 0, summing to 1 within ``MASS_TOL``.
        values: value vectors, shape ``(n, d)``; finite.
        field: name used in error messages (``"row"`` gives fields ``row.p``, ``row.values``).

    Returns:
        ``(p, values)`` as C-contiguous float64 arrays.

    Raises:
        InputError: naming the offending field, for any violation above or an empty row.
    """
    pf, vf = f"{field}.p", f"{field}.values"
    p_arr = _as_float_array(p, pf, 1)
    v_arr = _as_float_array(values, vf, 2)
    if p_arr.shape[0] == 0:
        raise InputError(pf, "is empty (a row needs at least one key)", "pass a row with n >= 1 keys")
    if v_arr.shape[0] != p_arr.shape[0]:
        raise InputError(
            vf, f"has {v_arr.shape[0]} value vectors but p has {p_arr.shape[0]} masses",
            "pass values of shape (n, d) aligned with p of shape (n,)",
        )
    _check_masses(p_arr, pf)
    _check_values(v_arr, vf)
    total = float(p_arr.sum())
    if abs(total - 1.0) > MASS_TOL:
        raise InputError(pf, f"sums to {total!r}, not 1 within {MASS_TOL:g}", "normalise p (p / p.sum()) or pass softmax outputs")
    return p_arr, v_arr


def validate_kept(kept: object, n: int, field: str = "kept") -> np.ndarray:
    """Check a kept set for a row of ``n`` keys; return it as int64 ``(k,)`` (order kept).

    Raises:
        InputError: if ``kept`` is empty, not 1-D integer, has an index outside ``[0, n)``
            or a repeated index.
    """
    arr = _as_int_array(kept, field, 1)
    if arr.shape[0] == 0:
        raise InputError(field, "is empty (keeping no key leaves the forced output undefined)", "keep at least one key")
    out = (arr < 0) | (arr >= n)
    if out.any():
        (i,) = _first_bad(out)
        raise InputError(f"{field}[{i}]", f"is {int(arr[i])}, outside [0, {n})", f"use key indices 0..{n - 1}")
    if np.unique(arr).shape[0] != arr.shape[0]:
        srt = np.sort(arr)
        dup = int(srt[1:][srt[1:] == srt[:-1]][0])
        raise InputError(field, f"repeats key {dup}", "pass each kept key once")
    return arr


def check_budget(s: object, n: int, field: str = "s") -> int:
    """Check a budget ``1 <= s <= n`` and return it as ``int``.

    Raises:
        InputError: if ``s`` is not an integer or is outside ``[1, n]``.
    """
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
        raise InputError(field, f"is {s!r}, not an integer", "pass an integer budget (number of kept keys)")
    s = int(s)
    if s < 1:
        raise InputError(field, f"is {s}, below 1", "keep at least one key (s >= 1)")
    if s > n:
        raise InputError(field, f"is {s}, above the number of keys n = {n}", f"use s <= {n}")
    return s


def check_count(r: object, field: str) -> int:
    """Check a non-negative integer count (e.g. the pool extensions ``r_m``, ``r_e``)."""
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or int(r) < 0:
        raise InputError(field, f"is {r!r}, not a non-negative integer", f"pass {field} >= 0")
    return int(r)


def validate_mass_batch(p: object, p_off: object) -> tuple[np.ndarray, np.ndarray]:
    """Check the masses and offsets of a ragged batch (no values); return them converted.

    Args:
        p: float ``[sum n_i]``: masses of all rows, concatenated.
        p_off: int ``[N+1]``: row i is ``p[p_off[i]:p_off[i+1]]``; starts at 0, ends at
            ``len(p)``, strictly increasing (no empty rows), ``N >= 1``.

    Returns:
        ``(p, p_off)`` as contiguous float64 / int64 arrays.

    Raises:
        InputError: naming the field (and row) of the first violation.
    """
    p_arr = _as_float_array(p, "p", 1)
    off = _as_int_array(p_off, "p_off", 1)
    if off.shape[0] < 2:
        raise InputError("p_off", f"has length {off.shape[0]}: the batch holds no rows", "pass at least one row (p_off = [0, n_0, ...])")
    n_rows = off.shape[0] - 1
    if off[0] != 0:
        raise InputError("p_off[0]", f"is {int(off[0])}, not 0", "offsets start at 0")
    if off[-1] != p_arr.shape[0]:
        raise InputError(f"p_off[{n_rows}]", f"is {int(off[-1])} but p has {p_arr.shape[0]} entries", "the last offset must equal len(p)")
    n = np.diff(off)
    if (n <= 0).any():
        (i,) = _first_bad(n <= 0)
        problem = "is empty (p_off does not increase)" if n[i] == 0 else f"has decreasing offsets ({int(off[i])} -> {int(off[i + 1])})"
        raise InputError(f"p_off[{i + 1}]", f"row {i} {problem}", "offsets must be strictly increasing: every row needs n >= 1 keys")
    _check_masses(p_arr, "p")
    sums = np.add.reduceat(p_arr, off[:-1])
    bad = np.abs(sums - 1.0) > MASS_TOL
    if bad.any():
        (i,) = _first_bad(bad)
        raise InputError(f"p (row {i})", f"row {i} masses sum to {float(sums[i])!r}, not 1 within {MASS_TOL:g}", "normalise each row's masses to sum to 1")
    return p_arr, off


def validate_batch(p: object, p_off: object, values: object, v_start: object) -> Batch:
    """Check a ragged batch (layout in ``docs/architecture.md``) and return it converted.

    Args:
        p: float ``[sum n_i]``: masses of all rows, concatenated.
        p_off: int ``[N+1]``: row i is ``p[p_off[i]:p_off[i+1]]``; starts at 0, ends at
            ``len(p)``, strictly increasing (no empty rows).
        values: float ``[K, d]``: the shared value pool.
        v_start: int ``[N]``: row i's values are ``values[v_start[i] : v_start[i] + n_i]``.

    Returns:
        :class:`Batch` with contiguous float64 / int64 arrays.

    Raises:
        InputError: naming the field (and row) of the first violation: NaN/inf, negative
            masses, a row whose masses do not sum to 1 within ``MASS_TOL``, an empty batch or
            row, offsets that are not monotone or do not cover ``p``, ``v_start`` out of range.
    """
    p_arr, off = validate_mass_batch(p, p_off)
    v_arr = _as_float_array(values, "values", 2)
    vs = _as_int_array(v_start, "v_start", 1)
    n_rows = off.shape[0] - 1
    n = np.diff(off)
    if vs.shape[0] != n_rows:
        raise InputError("v_start", f"has {vs.shape[0]} entries for {n_rows} rows", "pass one value-block start per row")
    _check_values(v_arr, "values")
    out = (vs < 0) | (vs + n > v_arr.shape[0])
    if out.any():
        (i,) = _first_bad(out)
        raise InputError(
            f"v_start[{i}]", f"row {i} needs values[{int(vs[i])}:{int(vs[i] + n[i])}] but values has {v_arr.shape[0]} vectors",
            "point v_start at a block of n_i value vectors inside values",
        )
    return Batch(p_arr, off, v_arr, vs)


def validate_kept_batch(kept: object, p_off: np.ndarray, field: str = "kept") -> np.ndarray:
    """Check kept sets for a batch: int ``(N, k)`` local indices, ``-1`` = padding.

    Each row must keep at least one key; valid entries are distinct and in ``[0, n_i)``.
    Padding may sit anywhere in the row (it is skipped).

    Returns:
        the kept array as C-contiguous int64 ``(N, k)``.
    """
    arr = _as_int_array(kept, field, 2)
    n_rows = p_off.shape[0] - 1
    if arr.shape[0] != n_rows:
        raise InputError(field, f"has {arr.shape[0]} rows for a batch of {n_rows}", "pass one kept row per attention row, padded with -1")
    n = np.diff(p_off)[:, None]
    bad = (arr < -1) | (arr >= n)
    if bad.any():
        i, j = _first_bad(bad)
        raise InputError(f"{field}[{i}, {j}]", f"is {int(arr[i, j])}, outside [0, {int(n[i, 0])}) and not the padding -1", f"use local key indices 0..{int(n[i, 0]) - 1} or -1")
    valid = arr >= 0
    empty = ~valid.any(axis=1) if arr.shape[1] > 0 else np.ones(n_rows, dtype=bool)
    if empty.any():
        (i,) = _first_bad(empty)
        raise InputError(f"{field}[{i}]", f"row {i} keeps no key", "keep at least one key per row")
    if arr.shape[1] > 1:
        srt = np.sort(arr, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            i, j = _first_bad(dup)
            raise InputError(f"{field}[{i}]", f"row {i} repeats key {int(srt[i, j])}", "pass each kept key once per row")
    return arr
