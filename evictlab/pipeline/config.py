"""Settings of the main job (what rows to produce, how to analyse them) and the stage error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evictlab.errors import EvictlabError, InputError


class StageError(EvictlabError, RuntimeError):
    """A pipeline stage (a subprocess command) failed; the message names the command."""


#: Bumped when the prompts a capture setting produces change (2: Shakespeare plays, one per
#: prompt, before the held-out tail), so cached rows of an older rule are never reused.
ROWS_RULE_VERSION = 2


@dataclass(frozen=True)
class CaptureSpec:
    """What rows to produce for one model (real capture, or synthetic rows)."""

    model: str
    context: int
    positions: int
    prompts: int
    source: str = "shakespeare"
    synthetic_rows: int = 0  # > 0: synthetic rows instead of a capture
    synthetic_keys: int = 0
    synthetic_dim: int = 64
    seed: int = 0

    @property
    def synthetic(self) -> bool:
        return self.synthetic_rows > 0

    def key(self) -> str:
        """Folder name under runs/cache/rows that identifies these rows (and the prompt rule's version)."""
        if self.synthetic:
            return f"synthetic-r{self.synthetic_rows}-k{self.synthetic_keys}-d{self.synthetic_dim}-seed{self.seed}"
        return (f"{self.model}-{self.source}-ctx{self.context}-pos{self.positions}-pr{self.prompts}-seed{self.seed}"
                f"-rule{ROWS_RULE_VERSION}")

    def label(self) -> str:
        """Model name as it appears in tables."""
        return "synthetic" if self.synthetic else self.model


@dataclass
class AnalysisConfig:
    """Settings of the statistics stages (all recorded in the report and run record)."""

    budgets: tuple[int, ...] = (4, 8, 16, 32)
    pool: tuple[int, int] = (2, 2)
    threshold: float = 1.11
    seed: int = 0
    n_boot: int = 1000
    n_boot_cells: int = 200
    hardness_trials: int = 40
    hardness_size: int = 8
    weights_note: str = "weights quantised (Q4 GGUF)"
    rows_note: str = ""
    #: rows per model for the free-weight ablations of pi(s) (a seeded sample, even over prompts)
    ablation_rows: int = 600
    #: torch threads of the capture stage (``evictlab capture --threads``; 0 = torch's default)
    threads: int = 1
    #: solver neighbourhood of the main rows (``evictlab solve --search``): ``all`` adds the
    #: all-key search (ES_ls) and the report's beyond-the-pool section; ``pool`` skips both
    search: str = "all"
    #: ``evictlab demo --quiet``: the stages' subprocesses run with ``--quiet`` (no progress bars)
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"4,8 16"`` -> ``(4, 8, 16)`` (sorted): the budgets s of ``demo --keep``; InputError naming
    ``--keep`` otherwise (the list rule of :mod:`evictlab.cliutil`: no empty entry, no budget twice)."""
    from evictlab.cliutil import parse_ints

    b = parse_ints(text.split(), "--keep", "kept-key count", lo=1, example="4,8,16,32")
    if not b:
        raise InputError("--keep", "no budget given", "pass e.g. --keep 4,8,16,32")
    return tuple(sorted(b))
