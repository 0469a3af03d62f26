"""Settings of one capture run (``evictlab capture``'s flags) and their checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from evictlab.errors import InputError, refuse_duplicates
from evictlab.tasks.sources import check_source


MODES = ("query-agnostic", "query-aware")


@dataclass
class CaptureConfig:
    """Settings of one capture run (the CLI flags of ``evictlab capture``)."""

    model: str = "smollm2-135m"
    source: str = "shakespeare"
    context: int = 2048
    positions: int = 32
    prompts: int = 4
    mode: str = "query-agnostic"
    layers: str = "all"
    device: str = "cpu"
    seed: int = 0
    rows_per_shard: int = 16384
    #: torch CPU threads (0 = torch's default). On a shared, oversubscribed machine one
    #: thread can be ~10x faster than two (spinning OpenMP workers); see docs/performance.md.
    threads: int = 0
    #: prompts per forward pass (consecutive prompts of equal length; text sources always
    #: are); 0 = auto: 8 on CUDA, 1 on CPU (docs/performance.md, capture batching)
    batch: int = 0

    def check(self) -> None:
        """InputError on any setting that cannot work, before the model is loaded."""
        from evictlab.tasks.texts import is_text_source

        check_source(self.source)
        if self.mode not in MODES:
            raise InputError("--protocol", f"unknown protocol {self.mode!r}", f"use one of: {', '.join(MODES)}")
        if self.mode == "query-aware" and is_text_source(self.source):
            raise InputError("--protocol", f"query-aware capture needs a question, {self.source} passages have none",
                             "use a task source (needle, multi_needle, multi_key, variable_tracking)")
        for name, val, lo in (("--context", self.context, 16), ("--positions", self.positions, 1),
                              ("--prompts", self.prompts, 1), ("--rows-per-shard", self.rows_per_shard, 1),
                              ("--batch", self.batch, 0)):
            if not isinstance(val, int) or val < lo:
                raise InputError(name, f"must be an integer >= {lo}, got {val!r}", f"pass {name} {max(lo, 1)} or more")
        if self.mode == "query-agnostic" and self.positions > self.context // 2:
            raise InputError("--positions", f"{self.positions} positions do not fit in the last half "
                             f"of a {self.context}-token context", f"use at most {self.context // 2}")
        parse_layers(self.layers, None)


def parse_layers(spec: str, n_layers: int | None) -> list[int] | None:
    """``"all"`` -> None; ``"0,5,10-12"`` -> ``[0, 5, 10, 11, 12]`` (checked against n_layers)."""
    from evictlab.cliutil import parse_list

    if spec.strip().lower() == "all":
        return None
    layers: list[int] = []
    try:
        for part in parse_list(spec, "--layers", "layer"):
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError(part)
                layers += range(a, b + 1)
            else:
                layers.append(int(part))
    except InputError:
        raise
    except ValueError:
        raise InputError("--layers", f"cannot parse {spec!r}", "use 'all' or a list like 0,5,10-12") from None
    refuse_duplicates(layers, "--layers", "layer")  # also a layer inside a range given again
    out = set(layers)
    if not out or min(out) < 0:
        raise InputError("--layers", f"{spec!r} selects no valid layer", "use 'all' or layers >= 0")
    if n_layers is not None and max(out) >= n_layers:
        raise InputError("--layers", f"layer {max(out)} does not exist (the model has {n_layers})",
                         f"use layers 0..{n_layers - 1}")
    return sorted(out)


def auto_batch(cfg: CaptureConfig, device_type: str) -> int:
    """Prompts per forward: ``--batch``, or with 0 (auto) 8 on CUDA and 1 on CPU."""
    return cfg.batch or (8 if device_type == "cuda" else 1)
