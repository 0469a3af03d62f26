"""The gate-training recipe's record: curves, convergence numbers, and shipping the gates.

    python paper_repro/gates_recipe.py RUN_FOLDER --figure figures/gates_training_smollm2 \
        [--load "06:43 7.1, ..."] [--ship data/gates/smollm2-135m]

Reads a finished ``evictlab gates train`` folder and

- draws the training curves (:func:`evictlab.plots.gates.gates_training`) to ``--figure``
  (``.png`` and ``.pdf``);
- prints the convergence numbers (:func:`evictlab.gates.train.convergence`: the last
  validation's retained mass over the budget, the KL over the last quarter), the time per
  step (wall and CPU, teacher pass apart) and the tokens seen;
- with ``--ship DIR``: copies the gates (``gates.safetensors``, ``gates.json`` with the
  model's ``weights_digest`` added when the run did not record it, ``losses.parquet``,
  ``run_record.json``) into ``DIR`` and writes ``DIR/training.json``: the command, commit,
  data, steps, final losses, convergence, timing (with ``--load``: the load averages seen
  during the run, since a shared machine's times are not an idle machine's) and the
  shipped size. ``--scorer-param gates=default`` then finds them (``data/gates/``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.gates import files
from evictlab.gates.train import convergence
from evictlab.io import atomic_write_json
from evictlab.plots.gates import gates_training


def summary(folder: Path) -> dict[str, Any]:
    """Everything ``training.json`` records about the run in ``folder``."""
    cfg = files.read_config(folder, "RUN_FOLDER")
    losses = pl.read_parquet(folder / files.LOSSES_FILE)
    rows = losses.to_dicts()
    record = json.loads((folder / "run_record.json").read_text()) if (folder / "run_record.json").is_file() else {}
    tr = cfg["training"]
    n = len(rows)
    recipe = cfg["recipe"]
    return {
        "command": " ".join(["evictlab", *record.get("argv", [])[1:]]) if record.get("argv") else None,
        "commit": (record.get("git") or {}).get("commit"),
        "dirty": (record.get("git") or {}).get("dirty"),
        "model": cfg["model"],
        "weights_digest": cfg.get("weights_digest"),
        "data": cfg["data"],
        "recipe": recipe,
        "steps": n,
        "tokens_seen": n * recipe["batch"] * cfg["data"]["seq_len"],
        "distinct_training_tokens": recipe["pool"] * cfg["data"]["seq_len"],
        "m_global": cfg["m_global"],
        "final": {"train_last10_mean": tr["last10_mean"], "validation": (cfg.get("validation") or [None])[-1],
                  "capacity_weight": cfg.get("capacity_weight_final")},
        "convergence": convergence(rows, cfg.get("validation") or []),
        "time": {"device": tr["device"], "threads": tr["threads"],
                 "wall_s_per_step": sum(r["wall_s"] for r in rows) / n, "cpu_s_per_step": sum(r["cpu_s"] for r in rows) / n,
                 "teacher": cfg.get("teacher"), "wall_s_total": tr["wall_s_this_call"],
                 "cpu_s_total": tr["cpu_s_this_call"]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a finished `evictlab gates train` folder")
    p.add_argument("--figure", type=Path, default=None, help="figure path without suffix (png and pdf)")
    p.add_argument("--load", default="", help="load averages seen during the run (recorded beside the times)")
    p.add_argument("--ship", type=Path, default=None, help="copy the gates here with training.json")
    p.add_argument("--commit", default="", help="the commit the run's code was at, when the tree moved on during the "
                   "run (the run record holds the commit at its end)")
    args = p.parse_args(argv)
    info = summary(args.folder)
    if args.commit:
        info["commit_at_run_end"], info["commit"] = info["commit"], args.commit
    info["time"]["load_average"] = args.load or None
    if args.figure is not None:
        cfg = files.read_config(args.folder, "RUN_FOLDER")
        fig = gates_training(pl.read_parquet(args.folder / files.LOSSES_FILE), cfg.get("validation") or [],
                             args.figure, title=f"{cfg['model']}: {info['steps']} steps x {cfg['recipe']['batch']} "
                             f"x {cfg['data']['seq_len']} tokens, M = {cfg['recipe']['capacity']} per KV head")
        print(f"figure: {fig.png}")
    if args.ship is not None:
        ship(args.folder, args.ship, info)
    print(json.dumps({k: info[k] for k in ("steps", "tokens_seen", "final", "convergence", "time")}, indent=1))
    return 0


def ship(folder: Path, dest: Path, info: dict[str, Any]) -> None:
    """Copy the gates of ``folder`` to ``dest`` (a new or shipped folder) with ``training.json``."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = files.read_config(folder, "RUN_FOLDER")
    if not cfg.get("weights_digest"):
        from evictlab.models.loading import load_model, weights_digest

        model, _ = load_model(cfg["model"])  # float32, as decode loads it
        cfg["weights_digest"] = info["weights_digest"] = weights_digest(model)
    for name in (files.WEIGHTS_FILE, files.LOSSES_FILE, "run_record.json"):
        shutil.copyfile(folder / name, dest / name)
    atomic_write_json(dest / files.CONFIG_FILE, cfg)
    files.load_gates(dest)  # the copy reads back and its checksum verifies
    info["shipped_bytes"] = {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.name != "training.json"}
    atomic_write_json(dest / "training.json", info)
    print(f"shipped to {dest}: {sum(info['shipped_bytes'].values())} bytes")


if __name__ == "__main__":
    from _common import entry

    entry(main)
