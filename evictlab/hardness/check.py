"""The reduction checker: decide source and image independently, compare, map certificates both ways.

For each generated source instance one trial

1. decides the source with CP-SAT and with the exact DP,
2. builds the image, checks its size against the proved bit-length bound,
3. decides the image with CP-SAT and with the exact DP (different formulations),
4. requires all four answers to equal the known answer (planted yes / proved no),
5. for a yes, maps every source certificate (planted, CP-SAT's, DP's) to the image and every
   image certificate (CP-SAT's, DP's) back to the source, verifying each in exact integers.

Any failed step makes the trial a disagreement; an exception inside a trial is recorded as one
too (with its message), never swallowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import polars as pl

from evictlab.hardness.deciders import Decision, check_time_limit, decide_image, decide_source
from evictlab.hardness.generators import Generated, balanced
from evictlab.hardness.instances import within_cpsat_limits
from evictlab.hardness.reduction import (
    image_bit_bound,
    image_to_source_certificate,
    reduce_instance,
    source_to_image_certificate,
)

SOLVERS = ("source_cpsat", "source_dp", "image_cpsat", "image_dp")


def _certificate_failures(gen: Generated, decisions: dict[str, Decision]) -> list[str]:
    """Map every certificate both ways and return what failed (empty when all verify)."""
    source = gen.source
    image = reduce_instance(source)
    problems: list[str] = []
    forward = {"planted": gen.planted, "source_cpsat": decisions["source_cpsat"].certificate,
               "source_dp": decisions["source_dp"].certificate}
    for name, cert in forward.items():
        if cert is None:
            continue
        if not source.is_certificate(cert):
            problems.append(f"{name} certificate {cert} fails on the source")
            continue
        mapped = source_to_image_certificate(source, cert)
        if not image.is_certificate(mapped):
            problems.append(f"{name} certificate {cert} maps to {mapped}, not a zero-error image subset")
    for name in ("image_cpsat", "image_dp"):
        cert = decisions[name].certificate
        if not image.is_certificate(cert):
            problems.append(f"{name} certificate {cert} fails on the image")
            continue
        back = image_to_source_certificate(source, cert)
        if not source.is_certificate(back):
            problems.append(f"{name} certificate {cert} maps back to {back}, not a source solution")
    return problems


def check_one(trial: int, gen: Generated, *, time_limit_s: float | None = None) -> dict[str, Any]:
    """Run one trial (see the module docstring) and return its row for the results table."""
    source = gen.source
    row: dict[str, Any] = {
        "trial": trial, "family": gen.family, "n": source.n, "k": source.k,
        "expected": "yes" if gen.expected_yes else "no",
        "image_n": None, "image_max_bits": None, "bit_bound": None,
        **{f"{name}": None for name in SOLVERS},
        **{f"{name}_s": None for name in SOLVERS},
        "certificates_checked": 0, "agreed": False, "error": None,
    }
    try:
        image = reduce_instance(source)
        row["image_n"] = image.n
        row["image_max_bits"] = max(abs(v).bit_length() for v in image.values)
        row["bit_bound"] = image_bit_bound(source)
        if not within_cpsat_limits(image):
            raise ValueError("image beyond CP-SAT's int64 limit; use a smaller magnitude")
        decisions = {
            "source_cpsat": decide_source(source, "cpsat", time_limit_s=time_limit_s),
            "source_dp": decide_source(source, "dp"),
            "image_cpsat": decide_image(image, "cpsat", time_limit_s=time_limit_s),
            "image_dp": decide_image(image, "dp"),
        }
        for name, d in decisions.items():
            row[name] = d.answer
            row[f"{name}_s"] = d.seconds
        problems: list[str] = []
        if row["image_max_bits"] > row["bit_bound"]:
            problems.append(f"image value of {row['image_max_bits']} bits exceeds the proved bound {row['bit_bound']}")
        wrong = [n for n, d in decisions.items() if d.yes != gen.expected_yes]
        if wrong:
            problems.append(f"{', '.join(wrong)} answered against the known {row['expected']}")
        elif gen.expected_yes:
            problems += _certificate_failures(gen, decisions)
            row["certificates_checked"] = 5 if gen.planted is not None else 4
        row["agreed"] = not problems
        row["error"] = "; ".join(problems) or None
    except Exception as exc:  # a crash inside a trial is a failed trial, reported with its message
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def run_check(
    instances: Iterable[Generated],
    *,
    time_limit_s: float | None = None,
    on_trial: Callable[[dict[str, Any]], None] | None = None,
) -> pl.DataFrame:
    """Check every instance; one row per trial (columns as in :func:`check_one`)."""
    rows = []
    for t, gen in enumerate(instances):
        rows.append(check_one(t, gen, time_limit_s=time_limit_s))
        if on_trial is not None:
            on_trial(rows[-1])
    schema = {"trial": pl.Int64, "family": pl.Utf8, "n": pl.Int64, "k": pl.Int64, "expected": pl.Utf8,
              "image_n": pl.Int64, "image_max_bits": pl.Int64, "bit_bound": pl.Int64,
              **{name: pl.Utf8 for name in SOLVERS}, **{f"{name}_s": pl.Float64 for name in SOLVERS},
              "certificates_checked": pl.Int64, "agreed": pl.Boolean, "error": pl.Utf8}
    return pl.DataFrame(rows, schema=schema)


@dataclass(frozen=True)
class Summary:
    """Counts and solver times over a results table."""

    tried: int
    yes: int
    no: int
    agreed: int
    disagreed: int
    certificates_checked: int
    seconds: dict[str, tuple[float, float, float]]  # solver -> (total, mean, max)

    @classmethod
    def of(cls, table: pl.DataFrame) -> "Summary":
        seconds = {}
        for name in SOLVERS:
            col = table[f"{name}_s"].drop_nulls()
            if len(col):
                seconds[name] = (float(col.sum()), float(col.mean()), float(col.max()))
            else:
                seconds[name] = (0.0, 0.0, 0.0)
        agreed = int(table["agreed"].sum())
        return cls(
            tried=table.height,
            yes=int((table["expected"] == "yes").sum()),
            no=int((table["expected"] == "no").sum()),
            agreed=agreed,
            disagreed=table.height - agreed,
            certificates_checked=int(table["certificates_checked"].sum()),
            seconds=seconds,
        )


def check_reduction(trials: int, size: int, *, seed: int = 0, magnitude: int | None = None,
                    time_limit_s: float | None = None,
                    on_trial: Callable[[dict[str, Any]], None] | None = None) -> tuple[pl.DataFrame, Summary]:
    """``evictlab hardness check``'s run: ``trials`` balanced instances of ``size`` values
    (:func:`~evictlab.hardness.generators.balanced`, seeded), each checked
    (:func:`run_check`); returns the table and its :class:`Summary`."""
    check_time_limit(time_limit_s)
    instances = balanced(seed, trials, size, magnitude)  # validates trials/size/magnitude first
    table = run_check(instances, time_limit_s=time_limit_s, on_trial=on_trial)
    return table, Summary.of(table)
