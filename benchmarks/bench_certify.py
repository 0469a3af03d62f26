"""Benchmark (not a test): the certified optimum -- closure rate and nodes per second at n = 64, 128, 256.

For each row dataset (real captured rows, or synthetic query rows when none are given) and
each budget s, the certificate of ``evictlab.solve.certify`` (direction + axis bounds,
``||x||`` order, leaf sweeps, best-first phase, seeded by the all-key search) runs with a
node limit, beside the **baseline** in the same process on the same rows: the previous
certificate (depth-first, axis bound only, keys in mass order, seeded by the pool argmin;
:func:`baseline_certify`). Reported per (dataset, s): rows closed (proved optimal) by each,
median and mean nodes, nodes per CPU second, CPU seconds per row, and for the new
certificate the median relative width ``(es_cert - cert_lb) / es_cert`` of the open rows.

    .venv/bin/python benchmarks/bench_certify.py --rows DIR [DIR ...] [--sample 60] [--nodes 20000000]
    # synthetic rows at n = 64, 128, 256 when no --rows is given

``--bound`` instead compares today's certificate with the certified lower bound of
``evictlab.solve.bound`` (``--bound-nodes``, default 64) in the same run, on the same rows
and seeds, at n = 256 and 512 and s = 8, 16 by default: per (dataset, s) the closure rate
of each (the certificate with ``--cert-max-n`` raised to the rows' n), CPU seconds per row,
and the median relative width ``(upper - lower) / upper`` of the rows each leaves open:

    .venv/bin/python benchmarks/bench_certify.py --bound [--rows DIR ...] [--sample 60] [--nodes 20000000]

``--bound-scaling`` runs the lower bound alone at several node limits (``--bound-nodes 64 512
4096``) on the same rows and seeds: per (dataset, s, limit) the rows closed, the rows whose
bound is still 0 (the root relaxation is 0, so the bound comes from branching), the median
relative width of the open rows and CPU seconds per row. It measures what a larger node
budget buys at real n (the ceiling bracket at 1k-4k tokens, docs/reproduction.md):

    .venv/bin/python benchmarks/bench_certify.py --bound-scaling --rows DIR ... --sample 16 --budgets 8 32 --bound-nodes 64 512 4096

Real rows used in docs/performance.md (SmolLM2-135M, Gemma-3-270M; shakespeare; n in
[C/2 + 1, C] for context C):
    evictlab capture --model smollm2-135m --context 128 --positions 8 --prompts 8 --out rows-smollm2-128
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit

from evictlab.solve.certify import _suffix_tables, axis_bound, batch_certify, CERT_REL_TOL
from evictlab.core.kernels import row_weighted_sum
from evictlab.core.ranking import rank_desc
from evictlab.solve.kernels import batch_solve, forced_error_exact
from evictlab.solve.localsearch import batch_localsearch


@njit(cache=True)
def baseline_certify(p: np.ndarray, V: np.ndarray, s: int, inc_set: np.ndarray, node_limit: int) -> tuple:
    """The previous certificate: depth-first, keys by decreasing mass, axis bound only.

    Returns ``(es, status (0 optimal / 1 limit), nodes)``; a leaf is one node, as a bound is.
    """
    n, d = V.shape
    mu = row_weighted_sum(p, V)
    inc = forced_error_exact(p, V, mu, np.sort(inc_set.copy()))
    order = rank_desc(p)
    X = np.empty((n, d))
    pw = np.empty(n)
    for a in range(n):
        pw[a] = p[order[a]]
        for t in range(d):
            X[a, t] = p[order[a]] * (V[order[a], t] - mu[t])
    _, sv, vt = np.linalg.svd(X, full_matrices=False)
    r = 0
    for t in range(sv.shape[0]):
        if sv[t] > 0.0:
            r += 1
    Y = X @ np.ascontiguousarray(vt[:max(r, 1)].T)
    r = Y.shape[1]
    lo, hi, pk = _suffix_tables(Y, pw, s)
    chosen = np.empty(s, dtype=np.int64)
    nxt = np.zeros(s + 1, dtype=np.int64)
    Sd = np.zeros((s + 1, r))
    Pd = np.zeros(s + 1)
    thr = inc * (1.0 - CERT_REL_TOL)
    nodes = 0
    depth = 0
    while depth >= 0:
        j = nxt[depth]
        k = s - depth
        if j > n - k:
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        if nodes >= node_limit:
            return inc, 1, nodes
        nodes += 1
        if axis_bound(Sd[depth], Pd[depth], j, k, lo, hi, pk) >= thr:
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        chosen[depth] = j
        for t in range(r):
            Sd[depth + 1, t] = Sd[depth, t] + Y[j, t]
        Pd[depth + 1] = Pd[depth] + pw[j]
        if depth + 1 == s:
            q = 0.0
            for t in range(r):
                q += Sd[s, t] * Sd[s, t]
            if Pd[s] > 0.0 and np.sqrt(q) / Pd[s] < inc:
                inc = np.sqrt(q) / Pd[s]
                thr = inc * (1.0 - CERT_REL_TOL)
            nxt[depth] = j + 1
            continue
        depth += 1
        nxt[depth] = j + 1
    return inc, 0, nodes


def _sample(batch, args: argparse.Namespace) -> tuple:
    """A seeded sample of ``--sample`` rows and its seeds (pool argmin, all-key search set).

    Returns ``(b, p, off, vs, V, bud, seeds_all, n)``; ``seeds_all`` is ``(2, rows, budgets, smax)``.
    """
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(batch.n_rows, size=min(args.sample, batch.n_rows), replace=False))
    b = batch.take(idx)
    p = np.ascontiguousarray(b.p, dtype=np.float64)
    off, vs = b.p_off, b.v_start
    V = np.ascontiguousarray(b.values, dtype=np.float64)
    bud = np.asarray(args.budgets, dtype=np.int64)
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    ls = batch_localsearch(p, off, V, vs, bud, b.meta["row_id"].to_numpy(), out[4], out[5], out[6], out[1],
                           np.ones((b.n_rows, bud.size), dtype=np.bool_), 8, 0, 0)
    return b, p, off, vs, V, bud, np.stack([out[5], ls[1]]), np.diff(off)


def bound_table(args: argparse.Namespace) -> None:
    """The certificate against the lower bound of ``solve.bound``, same rows and seeds, one thread."""
    from evictlab.solve.bound import batch_bound

    print("| rows | n | s | closed cert | closed bound | CPU s/row cert / bound | open width cert / bound (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, batch in _datasets(args):
        b, p, off, vs, V, bud, seeds_all, n = _sample(batch, args)
        batch_bound(p, off[:2], V, vs[:1], bud, seeds_all[:, :1], 3)  # compile before any timer
        batch_certify(p, off[:2], V, vs[:1], bud, seeds_all[:, :1], 10**6, 64, 100)  # compile
        for k, s in enumerate(args.budgets):
            sb = bud[k:k + 1]
            seeds = seeds_all[:, :, k:k + 1]
            t0 = time.process_time()
            es, _, st, lb, _ = batch_certify(p, off, V, vs, sb, seeds, int(n.max()), int(s), args.nodes)
            t_cert = time.process_time() - t0
            t1 = time.process_time()
            blb, bub, bst, _ = batch_bound(p, off, V, vs, sb, seeds, args.bound_nodes[0])
            t_bound = time.process_time() - t1
            oc, ob = st[:, 0] != 0, bst[:, 0] != 0
            wc = ((es[:, 0] - lb[:, 0]) / es[:, 0])[oc]
            wb = ((bub[:, 0] - blb[:, 0]) / bub[:, 0])[ob]
            print(f"| {name} | {n.min()}-{n.max()} | {s} | {1 - oc.mean():.1%} | {1 - ob.mean():.1%} | "
                  f"{t_cert / b.n_rows:.3f} / {t_bound / b.n_rows:.3f} | "
                  f"{np.median(wc) if wc.size else 0:.3f} / {np.median(wb) if wb.size else 0:.3f} |", flush=True)


def bound_scaling_table(args: argparse.Namespace) -> None:
    """The lower bound of ``solve.bound`` alone at each ``--bound-nodes`` limit, same rows and seeds."""
    from evictlab.solve.bound import batch_bound

    print("| rows | n | s | node limit | rows closed | rows with bound 0 | median width (open rows) | CPU s/row |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, batch in _datasets(args):
        b, p, off, vs, V, bud, seeds_all, n = _sample(batch, args)
        batch_bound(p, off[:2], V, vs[:1], bud, seeds_all[:, :1], 3)  # compile before any timer
        for k, s in enumerate(args.budgets):
            sb, seeds = bud[k:k + 1], seeds_all[:, :, k:k + 1]
            for nodes in args.bound_nodes:
                t = time.process_time()
                lb, ub, st, _ = batch_bound(p, off, V, vs, sb, seeds, nodes)
                t = time.process_time() - t
                open_ = st[:, 0] != 0
                w = ((ub[:, 0] - lb[:, 0]) / ub[:, 0])[open_]
                print(f"| {name} | {n.min()}-{n.max()} | {s} | {nodes:,} | {1 - open_.mean():.0%} | "
                      f"{np.mean(lb[:, 0] <= 0):.0%} | {np.median(w) if w.size else 0:.3f} | {t / b.n_rows:.2f} |",
                      flush=True)


def _datasets(args: argparse.Namespace) -> list[tuple[str, object]]:
    from evictlab.rows.reader import RowStore
    from evictlab.rows.synth import SynthConfig, synthesize

    out = []
    if args.rows:
        for d in args.rows:
            st = RowStore.open(d)
            out.append((f"{st.manifest.get('model')} {Path(d).name}", next(st.iter_batches(st.n_rows))))
        return out
    args.work.mkdir(parents=True, exist_ok=True)
    for n in args.sizes:
        path = args.work / f"synth-{n}"
        if not (path / "manifest.json").exists():
            synthesize(path, SynthConfig(rows=args.sample, keys=n, dim=64, seed=n, spread=0.0))
        st = RowStore.open(path)
        out.append((f"synthetic n={n}", next(st.iter_batches(st.n_rows))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, nargs="*", default=None, help="row datasets (default: synthetic)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/evictlab-bench-certify"))
    ap.add_argument("--sample", type=int, default=60, help="rows per dataset (seeded sample)")
    ap.add_argument("--budgets", type=int, nargs="+", default=None, help="default 4 8 (--bound: 8 16)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="n of the synthetic rows (default 64 128 256; --bound: 256 512)")
    ap.add_argument("--nodes", type=int, default=20_000_000, help="node limit per (row, s), both methods")
    ap.add_argument("--bound", action="store_true", help="compare the certificate with solve.bound instead")
    ap.add_argument("--bound-nodes", type=int, nargs="+", default=[64],
                    help="with --bound: the bound's node limit; with --bound-scaling: the limits to compare")
    ap.add_argument("--bound-scaling", action="store_true",
                    help="the bound alone at each --bound-nodes limit (no certificate), same rows and seeds")
    args = ap.parse_args()
    if min(args.bound_nodes) < 1 or min(args.sample, *(args.budgets or [1])) < 1:
        ap.error("--bound-nodes, --sample and --budgets must be >= 1")
    if len(args.bound_nodes) > 1 and not args.bound_scaling:
        ap.error("several --bound-nodes limits need --bound-scaling (--bound compares one limit with the certificate)")
    bound = args.bound or args.bound_scaling
    if args.budgets is None:
        args.budgets = [8, 16] if bound else [4, 8]
    if args.sizes is None:
        args.sizes = [256, 512] if bound else [64, 128, 256]
    numba.set_num_threads(1)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; one thread; node limit {args.nodes:,}")
    if args.bound_scaling:
        bound_scaling_table(args)
        return
    if args.bound:
        bound_table(args)
        return
    print("| rows | n | s | closed new | closed baseline | median nodes new / base | nodes/s new | nodes/s base "
          "| CPU s/row new / base | open width (median, new) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, batch in _datasets(args):
        b, p, off, vs, V, bud, seeds_all, n = _sample(batch, args)
        pool_sets = seeds_all[0]  # the baseline is seeded by the pool argmin only
        # warm-up (compilation) on one row
        batch_certify(p, off[:2], V, vs[:1], bud, seeds_all[:, :1], 10**6, 64, 1000)
        baseline_certify(p[off[0]:off[1]] / p[off[0]:off[1]].sum(), V[vs[0]:vs[0] + off[1] - off[0]], int(bud[0]),
                         pool_sets[0, 0, :bud[0]].copy(), 1000)
        for k, s in enumerate(args.budgets):
            sb = bud[k:k + 1]
            seeds = seeds_all[:, :, k:k + 1]
            t0 = time.process_time()
            es, kept, st, lb, nodes = batch_certify(p, off, V, vs, sb, seeds, 10**6, 64, args.nodes)
            t_new = time.process_time() - t0
            base = []
            t1 = time.process_time()
            for r in range(b.n_rows):
                pr = p[off[r]:off[r + 1]] / p[off[r]:off[r + 1]].sum()
                Vr = V[vs[r]:vs[r] + n[r]]
                base.append(baseline_certify(pr, Vr, int(s), pool_sets[r, k, :s].copy(), args.nodes))
            t_base = time.process_time() - t1
            bst = np.array([x[1] for x in base])
            bnodes = np.array([x[2] for x in base], dtype=float)
            closed = st[:, 0] == 0
            width = ((es[:, 0] - lb[:, 0]) / es[:, 0])[~closed]
            print(f"| {name} | {n.min()}-{n.max()} | {s} | {closed.mean():.1%} | {(bst == 0).mean():.1%} | "
                  f"{np.median(nodes[:, 0]):,.0f} / {np.median(bnodes):,.0f} | {nodes.sum() / max(t_new, 1e-9):.2e} | "
                  f"{bnodes.sum() / max(t_base, 1e-9):.2e} | {t_new / b.n_rows:.3f} / {t_base / b.n_rows:.3f} | "
                  f"{np.median(width) if width.size else 0:.3f} |", flush=True)


if __name__ == "__main__":
    main()
