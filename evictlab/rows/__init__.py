"""The attention-row dataset: schema, writer/reader, synthetic generator, export.

Format: ``docs/formats.md``. Public API::

    from evictlab.rows import RowWriter, RowStore, RowBatch, SynthConfig, synthesize, export_npz
"""

from evictlab.rows.export import export_npz
from evictlab.rows.schema import SCHEMA_VERSION
from evictlab.rows.store import RowBatch, RowStore, RowWriter
from evictlab.rows.synth import SynthConfig, synthesize

__all__ = [
    "SCHEMA_VERSION", "RowBatch", "RowStore", "RowWriter", "SynthConfig", "export_npz",
    "synthesize",
]
