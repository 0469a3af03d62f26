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
