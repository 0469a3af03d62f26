"""Capture throughput: rows per second of ``evictlab capture`` against a plain forward pass.

For each of ``--prompts`` Shakespeare prompts of ``--context`` tokens, times (same run,
same tokens, same thread count):

- ``forward``: the model's decoder stack alone (no hooks, no LM head), the unavoidable cost;
- ``capture``: the whole per-prompt capture: forward under hooks, float64 verification of
  every row against the module's own output, and writing blocks and rows to a RowWriter
  (the shard commit included, one prompt per shard).

Prints rows/s and the ratio capture / forward (the overhead of capturing). Rows per prompt
= layers x query heads x positions (SmolLM2: 30 x 9 x P).

With ``--batch B [B ...]`` it then times the capture of the same prompts with B prompts per
forward pass (``capture_batch``, equal-length prompts) and prints rows/s for each B and the
ratio against B = 1, measured in the same run on the same device (``--device cuda`` for the
GPU path).

    .venv/bin/python benchmarks/bench_capture.py --context 2048 --positions 32 --prompts 2 --threads 1
    .venv/bin/python benchmarks/bench_capture.py --context 256 --positions 4 --prompts 8 --batch 1 4 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    ap.add_argument("--batch", type=int, nargs="*", default=[], help="also time these prompts-per-forward sizes")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()

    from evictlab.tasks.sources import build_capture_prompt
    from evictlab.models.loading import check_device, load_model
    from evictlab.capture.forward import capture_batch, capture_prompt, query_positions, write_prompt
    from evictlab.rows.writer import RowWriter

    if args.threads:
        torch.set_num_threads(args.threads)
    device = check_device(args.device)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device)
    load_s = time.perf_counter() - t0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    body = getattr(model, "base_model", model)
    fwd, cap, rows = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        head_dim = model.config.head_dim if hasattr(model.config, "head_dim") else None
        with RowWriter(Path(tmp) / "rows", model=args.model, capture_mode="query-agnostic",
                       head_dim=int(head_dim), rows_per_shard=1) as w:
            for i in range(args.prompts):
                prompt = build_capture_prompt("shakespeare", args.context, tok, args.seed, i)
                ids = torch.tensor([prompt.tokens], device=device)
                t = time.perf_counter()
                with torch.inference_mode():
                    body(input_ids=ids, use_cache=False)
                sync()
                fwd.append(time.perf_counter() - t)
                pos = query_positions(prompt, "query-agnostic", args.positions, args.seed, i)
                t = time.perf_counter()
                caps = capture_prompt(model, prompt.tokens, pos, None, device)
                rows += write_prompt(w, i, prompt, "query-agnostic", caps)
                cap.append(time.perf_counter() - t)
    res = {
        "model": args.model, "context": args.context, "positions": args.positions,
        "prompts": args.prompts, "threads": torch.get_num_threads(), "load_s": round(load_s, 2),
        "rows": rows, "forward_s_per_prompt": round(float(np.median(fwd)), 2),
        "capture_s_per_prompt": round(float(np.median(cap)), 2),
        "rows_per_s": round(rows / sum(cap), 1),
        "capture_over_forward": round(float(np.median(cap) / np.median(fwd)), 2), "device": str(device),
    }
    if args.batch:
        prompts = [build_capture_prompt("shakespeare", args.context, tok, args.seed, i) for i in range(args.prompts)]
        pos = [query_positions(p, "query-agnostic", args.positions, args.seed, i) for i, p in enumerate(prompts)]
        per_b = {}
        for b in args.batch:
            t = time.perf_counter()
            n_rows = 0
            for j in range(0, len(prompts), b):
                items = capture_batch(model, [p.tokens for p in prompts[j:j + b]], pos[j:j + b], None, device)
                n_rows += sum(c.n_q_heads * c.positions.size for it in items for c in it.values())
            sync()
            per_b[b] = n_rows / (time.perf_counter() - t)
        res["batch_rows_per_s"] = {str(b): round(v, 1) for b, v in per_b.items()}
        base = per_b.get(1, per_b[args.batch[0]])
        res["batch_speedup"] = {str(b): round(v / base, 2) for b, v in per_b.items()}
        print("prompts per forward: " + ", ".join(f"{b}: {v:.0f} rows/s (x{v / base:.2f})" for b, v in per_b.items())
              + " (forward under hooks + verification, no writing)")
    print(f"{args.model}: context {args.context}, {rows} rows in {sum(cap):.1f} s = "
          f"{res['rows_per_s']:.0f} rows/s ({torch.get_num_threads()} thread(s)); forward alone "
          f"{res['forward_s_per_prompt']:.1f} s/prompt, capture {res['capture_s_per_prompt']:.1f} s/prompt "
          f"(x{res['capture_over_forward']:.2f}); model load {load_s:.1f} s")
    if args.out:
        from evictlab.io import atomic_write_json

        atomic_write_json(args.out, res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
