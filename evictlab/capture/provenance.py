"""What a dataset records about its capture (the manifest's ``source`` entry) and the resume
check: a rerun may only extend a dataset captured with the same settings and text.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from evictlab.capture.config import CaptureConfig, parse_layers
from evictlab.capture.forward import POSITIONS_RULE
from evictlab.errors import InputError
from evictlab.models.sites import find_attention_sites


#: The settings a resumed run must share with the dataset it extends.
_FIXED = ("model", "source", "context", "positions", "mode", "layers", "seed")
#: The option of a field whose name differs from it (the protocol is stored as ``mode``).
_OPTION = {"mode": "--protocol"}



def text_provenance(cfg: CaptureConfig) -> dict[str, str]:
    """For text sources: the prompt rule and a hash of the source's text (read now, so a
    missing file or a bad JSON line is reported before the model loads)."""
    from evictlab.tasks.texts import PROMPT_RULE, is_text_source, load_text_source

    if not is_text_source(cfg.source):
        return {}
    src = load_text_source(cfg.source)
    longest = max(len(d.text) for d in src.documents)
    if longest + 1 < cfg.context:  # a token covers at least one character (+1: a BOS token)
        raise InputError("--context", f"{cfg.context} tokens is longer than every text of {cfg.source} "
                         f"(longest: {longest} characters)",
                         f"use longer texts (English prose: about {4 * cfg.context} characters for {cfg.context} tokens) "
                         "or a smaller --context")
    return {"prompt_rule": PROMPT_RULE, "text_sha256": src.sha256()}


def check_resume(out: Path, cfg: CaptureConfig, text: dict[str, str]) -> None:
    man_path = out / "manifest.json"
    if not man_path.is_file():
        return
    try:
        src = json.loads(man_path.read_text()).get("source", {})
        old = src.get("capture", {})
    except (OSError, ValueError, AttributeError):
        return  # RowWriter reports a damaged manifest with its own message
    mine = asdict(cfg)
    diff = [k for k in _FIXED if k in old and old[k] != mine[k]]
    if diff:
        k = diff[0]
        raise InputError(_OPTION.get(k, f"--{k}"),
                         f"is {mine[k]!r} but the dataset at {out} was captured with {old[k]!r}",
                         "resume with the same settings (only --prompts may grow), or use a new --out")
    for key, what in (("prompt_rule", "an earlier prompt rule"), ("text_sha256", "a different text")):
        if key in text and src.get(key) != text[key]:
            raise InputError("--source", f"the dataset at {out} was captured from {what} "
                             f"({key} {src.get(key)!r:.40} vs {text[key]!r:.40})",
                             "use a new --out (its prompts could not be rebuilt)")


def source_info(cfg: CaptureConfig, model: Any, text: dict[str, str]) -> tuple[dict[str, Any], int, int]:
    """The manifest's ``source`` entry, the head dim and the layer count of a loaded model."""
    sites = find_attention_sites(model)
    head_dim = sites[0].head_dim
    if any(s.head_dim != head_dim for s in sites):
        raise InputError("--model", "layers have different head dims", "capture layers of one head dim (--layers)")
    source = {"capture": asdict(cfg), "model_class": type(model).__name__,
              "quantisation": _quantisation(cfg.model),
              "gqa": {str(s.layer): [s.n_q_heads, s.n_kv_heads] for s in sites},
              "sliding_window": {str(s.layer): s.sliding_window for s in sites},
              "positions_rule": POSITIONS_RULE[cfg.mode], **text}
    return source, head_dim, max(s.layer for s in sites) + 1


def _quantisation(name: str) -> str | None:
    from evictlab.models.registry import MODELS

    spec = MODELS.get(name)
    return spec.quantisation if spec else None


def capture_bytes(cfg: CaptureConfig, source: dict[str, Any], head_dim: int) -> int:
    """Bytes the dataset of ``cfg`` takes on disk, estimated (a little under: prompts are
    taken as ``--context`` tokens) from the model's heads per layer (``source["gqa"]``): per
    prompt and captured layer its keys and values (float32) and positions (int64) per KV
    head, and per row its query (float32) and index entry (~100 bytes)."""
    gqa = {int(k): v for k, v in source["gqa"].items()}
    layers = parse_layers(cfg.layers, max(gqa) + 1) or sorted(gqa)
    per_prompt = sum(gqa[l][1] * cfg.context * (2 * head_dim * 4 + 8) + gqa[l][0] * cfg.positions * (head_dim * 4 + 100)
                     for l in layers)
    return cfg.prompts * per_prompt


def check_size(cfg: CaptureConfig, source: dict[str, Any], head_dim: int, max_gib: float | None) -> None:
    """Refuse (:class:`InputError` on ``--prompts``) a dataset whose :func:`capture_bytes`
    exceed ``max_gib`` GiB (None: :data:`evictlab.io.DEFAULT_MAX_GIB`), before anything is written."""
    from evictlab.io import DEFAULT_MAX_GIB, check_output_size

    check_output_size(capture_bytes(cfg, source, head_dim), DEFAULT_MAX_GIB if max_gib is None else max_gib,
                      f"{cfg.prompts:,} prompts of {cfg.context:,} tokens with {cfg.positions} positions",
                      "capture fewer --prompts, --positions or --layers, or a shorter --context (or raise --max-gib)",
                      option="--prompts")
