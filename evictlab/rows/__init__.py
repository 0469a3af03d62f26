"""The attention-row dataset: schema, batch, writer, reader, synthetic generator, export.

Format: ``docs/formats.md``. Public API (imported lazily, so ``evictlab --help`` stays fast)::

    from evictlab.rows import RowWriter, RowStore, RowBatch, SynthConfig, synthesize, export_npz
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SCHEMA_VERSION": "evictlab.rows.schema",
    "RowBatch": "evictlab.rows.batch",
    "RowStore": "evictlab.rows.reader",
    "RowWriter": "evictlab.rows.writer",
    "SynthConfig": "evictlab.rows.synth",
    "synthesize": "evictlab.rows.synth",
    "export_npz": "evictlab.rows.export",
    "export_arrays": "evictlab.rows.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'evictlab.rows' has no attribute {name!r}")
