"""Decode-loop speed and memory, side by side with transformers' own sdpa generation and
with kvpress (results and commands in docs/performance.md, "Decode loop vs kvpress").

Runs, each in a fresh process (so a run's peak RSS is its own) on the same prompt
(evictlab's needle task at ``--context`` tokens, seed 0, query-agnostic: the context, then
the question, then ``--new`` greedy tokens), one torch thread each:

- ``hf_generate``: transformers' ``generate()`` with sdpa (one pass over context + question);
- ``full``: evictlab's loop, full cache (stock ``DynamicCache``), context in one pass;
- ``snapkv``: evictlab, physical store, SnapKV + uniform keeping ``--kept`` entries per
  cell (default 1/8 of the context), prefill chunk ``--chunk``, compression every 16 steps;
- ``snapkv_onepass``: the same with one prefill pass (chunk >= context);
- ``snapkv:N``: the ``snapkv`` run with prefill chunk ``N`` (any number of these);
- ``shared_prefill``: the shared prefill every one-pass arm of the grid starts from
  (:meth:`evictlab.decode.shared.SharedContext.prefill`: the stock cache plus the recorded
  queries) against the full cache's own prefill of the same context (the stock
  ``DynamicCache``, one causal call, as ``FullCache`` feeds it), in one process,
  alternating, ``--prefill-reps`` times each (medians; the first pair is a warm-up and not
  counted); the ratio "shared prefill / full prefill" (target <= 1.05, issue 23 item 9);
- ``kvpress_full`` / ``kvpress_snapkv``: kvpress 0.5.5 in its own venv
  (``benchmarks/peer_kvpress.py``): no press, and ``SnapKVPress`` keeping the same entries
  per head (``compression_ratio = 1 - kept / context``).

Every run (ours and the peers alike) gets ``MALLOC_MMAP_THRESHOLD_=131072`` (what
``evictlab decode`` sets with ``mallopt``) unless ``--malloc-default``; peak RSS is the
kernel's high-water mark since the model was loaded (VmHWM after a reset), so load-time
transients are not counted. ``--reps`` repetitions interleave the runs (A B C ... A B C ...); ratios are taken within a
repetition and reported as min / median / max over repetitions. The 1- and 5-minute load
averages are recorded before and after every run. The kvpress venv is created by this
script when ``--peer-venv`` has no python (``python3.11 -m venv``, ``pip install
torch==2.13.0`` first, then ``kvpress==0.5.5 'transformers<5.3' gguf accelerate``).

    .venv/bin/python benchmarks/bench_decode.py --context 4096 --reps 2 --out bench_decode.json
    .venv/bin/python benchmarks/bench_decode.py --runs full,snapkv --device cuda   # on a GPU
    .venv/bin/python benchmarks/bench_decode.py --runs shared_prefill --reps 1 --context 1024   # smaller

``--device cuda`` runs the evictlab and transformers runs on the GPU (peak GPU memory is
reported as well); the kvpress runs stay on the CPU unless ``--peer-device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = ("hf_generate", "full", "snapkv", "snapkv_onepass", "shared_prefill", "kvpress_full", "kvpress_snapkv")
PEER_PACKAGES = ("kvpress==0.5.5", "transformers<5.3", "gguf", "accelerate")
HERE = Path(__file__).resolve().parent
#: The issue's targets (label, run, baseline run, result key, target), each on wall time and
#: again on CPU time (process_time, one thread), which moves far less with the machine's load.
RATIOS = (
    ("full wall / hf_generate wall", "full", "hf_generate", "wall_s", "<= 1.05"),
    ("full cpu / hf_generate cpu", "full", "hf_generate", "cpu_s", "(cpu) <= 1.05"),
    ("snapkv wall / kvpress_snapkv wall", "snapkv", "kvpress_snapkv", "wall_s", "< 1"),
    ("snapkv cpu / kvpress_snapkv cpu", "snapkv", "kvpress_snapkv", "cpu_s", "(cpu) < 1"),
    ("snapkv KV peak / kvpress_snapkv KV peak", "snapkv", "kvpress_snapkv", "kv_peak_bytes", "<= 0.25"),
    ("snapkv KV peak / kvpress full-context KV", "snapkv", "kvpress_full", "kv_peak_bytes", "<= 0.25"),
    ("onepass peak RSS / chunked peak RSS", "snapkv_onepass", "snapkv", "peak_rss_bytes", "<= 1.2"),
    ("onepass wall / chunked wall", "snapkv_onepass", "snapkv", "wall_s", "<= 1.3"),
    ("onepass cpu / chunked cpu", "snapkv_onepass", "snapkv", "cpu_s", "(cpu) <= 1.3"),
    ("snapkv decode tok/s / full decode tok/s", "snapkv", "full", "decode_tok_s", ">= 1.6"),
    ("snapkv decode tok/cpu-s / full decode tok/cpu-s", "snapkv", "full", "decode_cpu_tok_s", "(cpu) >= 1.6"),
    ("full wall / kvpress_full wall", "full", "kvpress_full", "wall_s", "(info)"),
    ("full cpu / kvpress_full cpu", "full", "kvpress_full", "cpu_s", "(info)"),
)
#: Ratios of two measurements of one run (label, run, key, baseline key, target): the shared
#: prefill against the full cache's prefill of the same context, in the same process.
INNER_RATIOS = (
    ("shared prefill / full prefill", "shared_prefill", "prefill_s", "full_prefill_s", "<= 1.05"),
    ("shared prefill cpu / full prefill cpu", "shared_prefill", "prefill_cpu_s", "full_prefill_cpu_s", "(cpu) <= 1.05"),
)


# ------------------------------------------------------------------ child (one run, our venv)


def _child(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.loading import load_model

    prompt = json.loads(Path(args.prompt).read_text())
    dev = torch.device(args.device)
    t = time.perf_counter()
    model, _ = load_model(args.model, device=args.device,
                          attn_implementation="sdpa" if args.child == "hf_generate" else register_ragged_attention())
    load_s = time.perf_counter() - t
    ctx = torch.tensor([prompt["context_ids"]], device=dev)
    question = torch.tensor([prompt["question_ids"]], device=dev)
    n = ctx.shape[1]
    with torch.no_grad():
        model(input_ids=ctx[:, :16])  # warm-up, not timed
    rss_loaded = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    res: dict = {"run": args.child, "context": n, "question": question.shape[1], "new_tokens": args.new,
                 "load_s": load_s, "torch": torch.__version__}
    if args.child == "shared_prefill":
        res.update(_shared_prefill(model, ctx, args.prefill_reps, dev))
    elif args.child == "hf_generate":
        import transformers
        from transformers import LogitsProcessor, LogitsProcessorList

        first: list[float] = []

        class _FirstToken(LogitsProcessor):  # time stamp of the first generated token (prefill done)
            def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
                if not first:
                    first.extend((time.perf_counter(), time.process_time()))
                return scores

        ids = torch.cat([ctx, question], 1)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 min_new_tokens=args.new, do_sample=False,
                                 logits_processor=LogitsProcessorList([_FirstToken()]))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t_end, c_end = time.perf_counter(), time.process_time()
        res.update(tool=f"transformers {transformers.__version__} generate (sdpa)", wall_s=t_end - t0,
                   cpu_s=c_end - c0, prefill_s=first[0] - t0, decode_s=t_end - first[0],
                   decode_cpu_s=c_end - first[1],
                   decode_tok_s=(args.new - 1) / (t_end - first[0]), tokens=out[0, ids.shape[1]:].tolist(),
                   kv_peak_bytes=(n + question.shape[1] + args.new - 1) * _entry_bytes(model))
    else:
        name, _, chunk_arg = args.child.partition(":")  # "snapkv:512" = snapkv with that chunk
        chunk = 1 << 30 if name in ("full", "snapkv_onepass") else int(chunk_arg or args.chunk)
        if name == "full":
            cfg = DecodeConfig.of(mode="full", chunk_size=chunk)
        else:
            cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", args.kept or n // 8),
                               scorer="snapkv", chunk_size=chunk, compress_every=16)
        fed, dec_start = [0], []

        def tick(tokens: int) -> None:  # the decode phase starts once context + question are fed
            fed[0] += tokens
            if fed[0] == n + question.shape[1] and not dec_start:
                dec_start.append(time.process_time())

        t0, c0 = time.perf_counter(), time.process_time()
        out = run_sequence(model, ctx, question, cfg, max_new_tokens=args.new, progress=tick)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        full_kv = (n + question.shape[1] + args.new - 1) * _entry_bytes(model)
        res.update(tool="evictlab (ragged sdpa)", wall_s=wall, cpu_s=cpu, prefill_s=wall - out.decode_s, decode_s=out.decode_s,
                   decode_cpu_s=c0 + cpu - dec_start[0],
                   decode_tok_s=(args.new - 1) / out.decode_s, tokens=out.tokens[0].tolist(),
                   chunk=min(chunk, n), kept_per_cell=out.budget_tokens and out.budget_tokens // _cells(model),
                   compressions=out.compressions,
                   kv_peak_bytes=out.peak("bytes_live") or full_kv, kv_alloc_peak_bytes=out.peak("bytes_allocated"),
                   kv_end_bytes=out.trace[-1].report.bytes_live if out.trace else full_kv)
    res.update(peak_rss_bytes=run_peak_rss(), rss_loaded_bytes=rss_loaded,
               process_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if dev.type == "cuda":
        res["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return res


def _shared_prefill(model, ctx, reps: int, dev) -> dict:  # noqa: ANN001 - a loaded model, tensors
    """The shared prefill (``SharedContext.prefill``) and the full cache's prefill of ``ctx``,
    alternating (shared first on even repetitions), ``reps`` timed pairs after one warm-up
    pair; medians of wall and CPU seconds per side."""
    import torch
    from transformers import DynamicCache

    from evictlab.decode.shared import SharedContext

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def full() -> None:
        with torch.no_grad():  # FullCache.forward on the whole context: the stock cache, one causal call
            model(input_ids=ctx, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

    def shared() -> None:
        SharedContext.prefill(model, ctx)

    times: dict[str, list[tuple[float, float]]] = {"shared": [], "full": []}
    for rep in range(reps + 1):
        order = (("shared", shared), ("full", full)) if rep % 2 == 0 else (("full", full), ("shared", shared))
        for name, fn in order:
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            if rep > 0:  # the first pair warms both paths up
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    return {"tool": "evictlab SharedContext.prefill vs stock DynamicCache prefill", "prefill_s": med["shared"][0],
            "prefill_cpu_s": med["shared"][1], "full_prefill_s": med["full"][0], "full_prefill_cpu_s": med["full"][1],
            "wall_s": med["shared"][0], "cpu_s": med["shared"][1], "prefill_reps": reps,
            "prefill_times": {k: [list(t) for t in v] for k, v in times.items()}, "tokens": [],
            "kv_peak_bytes": ctx.shape[1] * _entry_bytes(model)}


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) after loading, so :func:`run_peak_rss` is the
    run's own peak (model weights resident, load-time transients excluded); returns the RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:  # not Linux, or not permitted: the process peak is reported instead
        pass
    return _status("VmRSS")


def run_peak_rss() -> int:
    """Peak RSS since :func:`reset_peak_rss` (VmHWM), in bytes."""
    return _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(field: str) -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _entry_bytes(model) -> int:  # noqa: ANN001
    """K/V bytes of one token over every layer and KV head."""
    from evictlab.models.geometry import model_geometry

    g = model_geometry(model)
    return g.cells * 2 * g.head_dim * g.dtype_bytes


def _cells(model) -> int:  # noqa: ANN001
    from evictlab.models.geometry import model_geometry

    return model_geometry(model).cells


# ------------------------------------------------------------------ parent (orchestration)


def ensure_peer(venv: Path, pip_args: list[str]) -> Path:
    """The kvpress venv's python, creating the venv when it has none."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import kvpress"], capture_output=True).returncode == 0:
        return py
    print(f"creating the kvpress venv in {venv} ...", file=sys.stderr, flush=True)
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet", *pip_args]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first: pinned, so nothing pulls another build
    subprocess.run([*pip, *PEER_PACKAGES], check=True)
    return py


def _prompt(model: str, context: int, path: Path) -> None:
    from evictlab.tasks.synthetic import make_task
    from evictlab.tasks.examples import tokenize_task
    from evictlab.models.loading import load_model

    _, tok = load_model(model)
    p = tokenize_task(make_task("needle", context, tok, 0), tok)  # fed query-agnostic (the loop's default)
    path.write_text(json.dumps({"context_ids": list(p.context_ids), "question_ids": list(p.question_ids),
                                "answer": p.answer}))


def _model_dir(model: str) -> str:
    from evictlab.models.loading import resolve

    return str(resolve(model)[1])


def _run_one(name: str, args: argparse.Namespace, work: Path, peer_py: Path | None, rep: int) -> dict:
    result = work / f"{name}.{rep}.json"
    if name.startswith("kvpress_"):
        assert peer_py is not None
        cmd = [str(peer_py), str(HERE / "peer_kvpress.py"), "--model-dir", _model_dir(args.model),
               "--prompt", str(work / "prompt.json"), "--press", name.removeprefix("kvpress_").replace("full", "none"),
               "--kept", str(args.kept or 0), "--new", str(args.new), "--threads", str(args.threads),
               "--device", args.peer_device, "--result", str(result)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--prompt", str(work / "prompt.json"),
               "--model", args.model, "--chunk", str(args.chunk), "--kept", str(args.kept or 0), "--new", str(args.new),
               "--threads", str(args.threads), "--device", args.device, "--prefill-reps", str(args.prefill_reps),
               "--result", str(result)]
        env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    if not args.malloc_default:  # every run alike: glibc returns freed large blocks at once (see docs)
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    load0 = os.getloadavg()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(result.read_text())
    res.update(run=name, rep=rep, load_before=load0[:2], load_after=os.getloadavg()[:2])
    return res


def _table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r.get(c):.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                     for c in cols) + " |")
    return "\n".join(out)


def _summary(results: list[dict], runs: list[str]) -> tuple[list[dict], list[dict]]:
    """Per-run medians, and the issue's ratios per repetition (min / median / max)."""
    by = {r: [x for x in results if x["run"] == r] for r in runs}
    rows = []
    for r, xs in by.items():
        for x in xs:
            if "decode_cpu_s" in x:
                x["decode_cpu_tok_s"] = (x["new_tokens"] - 1) / x["decode_cpu_s"]
        keys = ("wall_s", "cpu_s", "prefill_s", "decode_s", "decode_tok_s", "decode_cpu_tok_s", "kv_peak_bytes",
                "peak_rss_bytes")
        med = {k: statistics.median(x[k] for x in xs if k in x) for k in keys if any(k in x for x in xs)}
        rows.append({"run": r, "reps": len(xs), "wall_s": med["wall_s"], "cpu_s": med["cpu_s"],
                     "prefill_s": med["prefill_s"], "decode_tok_s": med.get("decode_tok_s"),
                     "decode_cpu_tok_s": med.get("decode_cpu_tok_s"), "kv_peak_MB": med["kv_peak_bytes"] / 1e6,
                     "peak_rss_MB": med["peak_rss_bytes"] / 1e6, "tool": xs[0].get("tool", "")})
    ratios = []
    reps = sorted({x["rep"] for x in results})

    def ratio(label: str, a: str, b: str, key: str, target: str) -> None:
        if a not in by or b not in by:
            return
        vals = []
        for rep in reps:
            xa = [x for x in by[a] if x["rep"] == rep]
            xb = [x for x in by[b] if x["rep"] == rep]
            if xa and xb and key in xa[0] and key in xb[0]:
                vals.append(xa[0][key] / xb[0][key])
        if vals:
            ratios.append({"ratio": label, "min": min(vals), "median": statistics.median(vals), "max": max(vals),
                           "target": target})

    for label, a, b, key, target in RATIOS:
        ratio(label, a, b, key, target)
    for label, a, key, base, target in INNER_RATIOS:
        vals = [x[key] / x[base] for x in by.get(a, []) if x.get(base)]
        if vals:
            ratios.append({"ratio": label, "min": min(vals), "median": statistics.median(vals), "max": max(vals),
                           "target": target})
    return rows, ratios


def _collect(folders: list[str]) -> tuple[list[dict], list[str]]:
    """Per-run results ``<run>.<rep>.json`` of earlier ``--work`` folders; repetitions are
    numbered across folders, so ratios pair runs of the same folder and repetition only."""
    results: list[dict] = []
    runs: list[str] = []
    for i, folder in enumerate(folders):
        for path in sorted(Path(folder).glob("*.json")):
            name, _, rep = path.stem.rpartition(".")
            if not rep.isdigit() or name.partition(":")[0] not in RUNS:
                continue
            res = json.loads(path.read_text())
            res.update(run=name, rep=f"{i}.{rep}")
            results.append(res)
            if name not in runs:
                runs.append(name)
    contexts = {(x["context"], x["new_tokens"]) for x in results}
    if len(contexts) > 1:
        sys.exit(f"--summarize: the folders hold runs of different (context, new tokens) {sorted(contexts)}; "
                 "summarize one benchmark setting at a time")
    return results, [r for r in RUNS if r in runs] + sorted(r for r in runs if r not in RUNS)


def _print_tables(results: list[dict], runs: list[str]) -> tuple[list[dict], list[dict]]:
    runs = list(dict.fromkeys(runs))
    rows, ratios = _summary(results, runs)
    print(_table(rows, ["run", "reps", "wall_s", "cpu_s", "prefill_s", "decode_tok_s", "decode_cpu_tok_s", "kv_peak_MB",
                        "peak_rss_MB", "tool"]))
    print()
    print(_table(ratios, ["ratio", "min", "median", "max", "target"]))
    first = {r: next(x["tokens"] for x in results if x["run"] == r) for r in runs}
    if "full" in first and "hf_generate" in first:
        print(f"\nfull == hf_generate tokens: {first['full'] == first['hf_generate']}")
    return rows, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kept", type=int, default=0, help="kept entries per cell (default: context / 8)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the chunked snapkv run")
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefill-reps", type=int, default=3,
                    help="timed pairs (shared, full) inside one shared_prefill run, after a warm-up pair")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="device of the evictlab and transformers runs")
    ap.add_argument("--peer-device", default="cpu", help="device of the kvpress runs")
    ap.add_argument("--peer-venv", default=str(Path.home() / ".cache" / "evictlab" / "bench" / "kvpress-0.5.5"))
    ap.add_argument("--peer-pip-arg", action="append", default=[], help="extra pip argument for the kvpress venv")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc's adaptive mmap threshold on (default: MALLOC_MMAP_THRESHOLD_=128KiB for every "
                         "run, as `evictlab decode` sets it)")
    ap.add_argument("--work", default="", help="folder for the prompt and per-run results (default: a temp dir)")
    ap.add_argument("--out", default="")
    ap.add_argument("--summarize", nargs="+", default=[], metavar="WORK",
                    help="only print the tables from the per-run results (<run>.<rep>.json) already in these --work "
                         "folders (each folder's repetitions counted separately), e.g. of an interrupted run")
    # child mode (internal)
    ap.add_argument("--child", default="")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--result", default="")
    args = ap.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(_child(args)))
        return
    import tempfile

    if args.summarize:
        _print_tables(*_collect(args.summarize))
        return
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r.partition(":")[0] not in RUNS or (":" in r and not r.startswith("snapkv:"))]
    if unknown:
        ap.error(f"unknown runs {unknown}; use some of {','.join(RUNS)}")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_decode_"))
    work.mkdir(parents=True, exist_ok=True)
    _prompt(args.model, args.context, work / "prompt.json")
    n = len(json.loads((work / "prompt.json").read_text())["context_ids"])
    args.kept = args.kept or n // 8
    peer_py = ensure_peer(Path(args.peer_venv), args.peer_pip_arg) if any(r.startswith("kvpress") for r in runs) else None
    t0 = time.time()
    results = []
    for rep in range(args.reps):
        for name in runs:
            res = _run_one(name, args, work, peer_py, rep)
            results.append(res)
            decode = (f"decode {res['decode_tok_s']:.2f} tok/s" if "decode_tok_s" in res else
                      f"full prefill {res['full_prefill_s']:.2f} s")
            print(f"rep {rep} {name}: wall {res['wall_s']:.1f} s, cpu {res['cpu_s']:.1f} s, {decode}, "
                  f"KV peak {res['kv_peak_bytes'] / 1e6:.1f} MB, RSS {res['peak_rss_bytes'] / 1e6:.0f} MB, "
                  f"load {res['load_before'][0]:.1f}->{res['load_after'][0]:.1f}", file=sys.stderr, flush=True)
    print(f"context {n} tokens (+{results[0]['question']} question), {args.new} new tokens, kept {args.kept} per "
          f"cell/head, chunk {args.chunk}, {args.threads} thread(s), {args.reps} interleaved reps, "
          f"{time.time() - t0:.0f} s\n")
    rows, ratios = _print_tables(results, runs)
    if args.out:
        record = {"argv": sys.argv, "context": n, "args": vars(args), "results": results, "summary": rows,
                  "ratios": ratios}
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
