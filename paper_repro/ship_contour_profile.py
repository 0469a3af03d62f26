"""Fit a ContourKV profile to ship in data/contour/ and write its provenance beside it.

``ROWS`` is a row dataset from ``evictlab capture`` (its ``run_record.json`` gives the capture
command and commit); the profile is fitted exactly as ``evictlab contour fit ROWS`` fits it
(:func:`evictlab.contour.fit.fit_profile`) and written to ``data/contour/<model>.json``, with
``<model>.provenance.json``: the capture and fit commands, the commits, the rows (count,
prompts, key-count range, manifest SHA-256) and the profile's SHA-256
(tests/test_contour_shipped.py checks it). ``profile=default`` then picks it for any model of
that geometry (``evictlab.contour.shipped``).

    evictlab capture --model smollm2-135m --source shakespeare --context 1024 --positions 16 \
        --prompts 4 --threads 1 --out runs/contour-rows/smollm2-135m
    .venv/bin/python paper_repro/ship_contour_profile.py runs/contour-rows/smollm2-135m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", type=Path, help="row dataset (evictlab capture --out ROWS)")
    p.add_argument("--folder", type=Path, default=None, help="default: the repository's data/contour/")
    args = p.parse_args(argv)

    from evictlab.contour.fit import fit_profile
    from evictlab.contour.shipped import SHIPPED_DIR
    from evictlab.io import atomic_write_json
    from evictlab.record import RunRecord

    folder = args.folder or SHIPPED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    capture = json.loads((args.rows / "run_record.json").read_text())
    record = RunRecord(kind="paper_repro.ship_contour_profile", config={"rows": str(args.rows)})
    prof = fit_profile(args.rows)
    out = folder / f"{prof.model}.json"
    prof.save(out)
    fit = record.to_dict()
    cap_argv = ["evictlab", *capture["argv"][1:]]
    provenance = {
        "profile": out.name,
        "profile_sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        "model": prof.model,
        "what": "ContourKV profile (per cell: the mean dropped mass outside each row's own top-b keys, on relative "
                "budgets b/n) for profile=default and contourkv_offline: rows of the same model on other text than "
                "the evaluation's tasks",
        "commands": [shlex.join(cap_argv).replace(str(args.rows), "ROWS"),
                     shlex.join(["python", "paper_repro/ship_contour_profile.py", "ROWS"]) +
                     "   # = evictlab contour fit ROWS --out data/contour/" + out.name],
        "commit": fit["git"]["commit"],
        "rows": {k: prof.source[k] for k in ("rows_used", "prompts", "n_min", "n_max", "n_mean", "capture_mode",
                                              "manifest_sha256")},
        "capture": {"config": capture["config"], "git": capture["git"], "wall_time_s": capture.get("wall_time_s"),
                    "started": capture.get("started")},
        "fit": {"git": fit["git"], "wall_time_s": fit["wall_time_s"], "started": fit["started"],
                "packages": fit["packages"]},
    }
    atomic_write_json(folder / f"{prof.model}.provenance.json", provenance)
    print(f"wrote {out} and {prof.model}.provenance.json ({prof.source['rows_used']} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
