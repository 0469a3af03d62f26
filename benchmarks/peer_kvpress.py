"""The kvpress side of ``benchmarks/bench_decode.py``: run in kvpress's own venv (torch,
transformers < 5.3, kvpress 0.5.5; nothing from evictlab is imported here, only the
stdlib helpers of ``bench_decode.py`` beside it).

One run: load the model with sdpa attention, prefill the context through the base model
(no LM head) inside the press (as ``KVPressTextGenerationPipeline._forward`` does), feed the
question with ``logits_to_keep=1`` at positions continuing the original context (as its
``generate_answer``), then greedy-decode ``--new`` tokens (no early stop, so every run decodes
the same number of tokens). Writes one JSON result: times, tokens, the peak K/V bytes the
cache held (measured by a forward hook on every attention module, registered before the
press's own hooks, so it sees each layer's full K/V just before the press prunes it), and
the process's peak RSS. A prompt with ``questions`` (a list of ``{"question_ids", "new"}``,
as ``bench_eval.py`` writes for a context asked several questions) answers each from its
own copy of the compressed cache (``new`` greedy tokens each), after one prefill.

    python peer_kvpress.py --model-dir DIR --prompt prompt.json --press snapkv --kept 512 --result out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import time

import torch
from bench_decode import reset_peak_rss, run_peak_rss  # stdlib only; this script's folder is on sys.path


def cache_bytes(cache) -> int:  # noqa: ANN001 - a transformers Cache
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt", required=True, help="JSON with context_ids and question_ids")
    ap.add_argument("--press", choices=["none", "snapkv"], default="none")
    ap.add_argument("--kept", type=int, default=0, help="context entries kept per KV head (snapkv)")
    ap.add_argument("--window", type=int, default=64, help="SnapKVPress window_size")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    prompt = json.load(open(args.prompt))
    dev = torch.device(args.device)
    ctx = torch.tensor([prompt["context_ids"]], device=dev)
    asked = prompt.get("questions") or [{"question_ids": prompt["question_ids"], "new": args.new}]
    question = torch.tensor([asked[0]["question_ids"]], device=dev)
    n = ctx.shape[1]
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model.to(dev).eval()
    t_load = time.perf_counter() - t_load
    press = None
    ratio = 0.0
    if args.press == "snapkv":
        from kvpress import SnapKVPress

        ratio = 1.0 - args.kept / n
        press = SnapKVPress(compression_ratio=ratio, window_size=args.window)

    peak = [0]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ctx[:, :16])  # warm-up (no cache), not timed
    rss_loaded = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def track(module, inp, kwargs, out) -> None:  # noqa: ANN001 - a forward hook
        peak[0] = max(peak[0], cache_bytes(cache))

    handles = [layer.self_attn.register_forward_hook(track, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        if press is not None:
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)
        else:
            model.model(input_ids=ctx, past_key_values=cache)
        t_prefill = time.perf_counter() - t0
        kv_after_prefill = cache_bytes(cache)
        for h in handles:  # the peak is in the prefill; decoding only appends
            h.remove()
        dec_s = dec_cpu = 0.0
        answers, end_bytes = [], 0
        for qa in asked:
            qcache = copy.deepcopy(cache) if len(asked) > 1 else cache  # each question from the compressed cache
            q = torch.tensor([qa["question_ids"]], device=dev)
            pos = torch.arange(n, n + q.shape[1], device=dev)[None]
            out = model(input_ids=q, past_key_values=qcache, position_ids=pos, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            pos = pos[:, -1:] + 1
            t_dec, c_dec = time.perf_counter(), time.process_time()
            for i in range(int(qa["new"]) - 1):
                out = model(input_ids=torch.tensor([[tokens[-1]]], device=dev), past_key_values=qcache,
                            position_ids=pos + i)
                tokens.append(int(out.logits[0, -1].argmax()))
            sync()
            dec_s, dec_cpu = dec_s + time.perf_counter() - t_dec, dec_cpu + time.process_time() - c_dec
            answers.append(tokens)
            end_bytes = max(end_bytes, cache_bytes(qcache))
        t_end, c_end = time.perf_counter(), time.process_time()
        new_total = sum(int(qa["new"]) - 1 for qa in asked)
    run_peak = run_peak_rss()
    from importlib.metadata import version

    result = {
        "run": f"kvpress_{args.press}", "tool": f"kvpress {version('kvpress')} (transformers {version('transformers')}, sdpa)",
        "transformers": version("transformers"), "torch": torch.__version__,
        "context": n, "question": question.shape[1], "new_tokens": int(asked[0]["new"]), "questions": len(asked),
        "compression_ratio": ratio,
        "kept_per_head": args.kept if press is not None else n, "load_s": t_load,
        "wall_s": t_end - t0, "cpu_s": c_end - c0, "prefill_s": t_prefill, "decode_s": dec_s,
        "decode_cpu_s": dec_cpu,
        "decode_tok_s": new_total / dec_s if dec_s > 0 else float("nan"),
        "kv_peak_bytes": max(peak[0], end_bytes), "kv_after_prefill_bytes": kv_after_prefill,
        "kv_end_bytes": end_bytes,
        "peak_rss_bytes": run_peak, "rss_loaded_bytes": rss_loaded,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "tokens": answers[0],
        "answers": answers,
    }
    if dev.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    with open(args.result, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
