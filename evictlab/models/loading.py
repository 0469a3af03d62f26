"""Loading a model for capture and decoding: registry names, local folders and hub ids.

Anything that is not a registry name is treated as a local Hugging Face folder (if such a
directory exists) or else as a hub id, and goes through the same ``from_pretrained`` call.

The attention implementation is chosen at load time (``attn_implementation=``, transformers'
name), never by editing ``model.config`` afterwards:

- ``"eager"`` (the default; capture): the explicit softmax, which capture's exactness
  contract is stated against;
- a name registered in transformers' ``AttentionInterface``: the decode loop and the audit
  load with evictlab's ragged attention, whose name
  (:data:`evictlab.kv.cache.RAGGED_ATTENTION`) the caller gets from
  :func:`evictlab.kv.cache.register_ragged_attention` (scaled-dot-product kernels over the
  store's cells inside the loop, transformers' own ``sdpa`` anywhere else); this module
  knows nothing of the KV store;
- ``"sdpa"``: transformers' own, unchanged (the baseline of ``benchmarks/bench_decode.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evictlab.errors import CorruptFileError, InputError
from evictlab.models.pull import pull, verify_folder
from evictlab.models.registry import DEFAULT_MODEL, MANIFEST, MODELS, known_names, model_dir

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


# --------------------------------------------------------------------------- loading


def resolve(name: str) -> tuple[str, Path | str]:
    """Classify ``name``: ``("registry", folder)``, ``("local", folder)`` or ``("hub", id)``.

    Registry models are pulled (installed and converted) on first use.
    """
    if name in MODELS:
        dest = model_dir(name)
        if not (dest / MANIFEST).is_file():
            pull(name)
        verify_folder(dest, name)
        return "registry", dest
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError("--model", f"folder {path} has no config.json",
                             "point at a Hugging Face model folder (config.json + weights)")
        return "local", path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise InputError("--model", f"{name!r} is not a known model, a model folder or a hub id",
                         f"use one of: {known_names()}, or a local Hugging Face model folder")
    return "hub", name


def check_model_name(name: str, option: str = "--model") -> None:
    """Refuse (field ``option``) a model that is neither a registry name, a model folder nor
    a hub id, without loading or pulling anything (what a command checks before any work)."""
    if name in MODELS:
        return
    try:
        resolve(name)
    except InputError as exc:
        raise InputError(option, exc.problem, exc.fix) from None


#: transformers' own implementations evictlab loads with (others must be registered first).
ATTENTIONS = ("eager", "sdpa")


def check_attn_implementation(name: str) -> str:
    """``name`` if a model can be loaded with it: one of :data:`ATTENTIONS` or a name
    registered in transformers' ``AttentionInterface`` (evictlab's ragged attention, after
    :func:`evictlab.kv.cache.register_ragged_attention`); InputError for anything else."""
    from transformers import AttentionInterface

    if name in ATTENTIONS or (isinstance(name, str) and name in AttentionInterface()):
        return name
    raise InputError("attn_implementation", f"unknown attention implementation {name!r}",
                     f"use one of: {', '.join(ATTENTIONS)}, or register it in transformers' AttentionInterface "
                     "first (evictlab.kv.cache.register_ragged_attention() for the decode loop's)")


def load_model(
    name: str = DEFAULT_MODEL, device: str = "cpu", dtype: "torch.dtype | None" = None,
    attn_implementation: str = "eager",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode on ``device``.

    ``name`` is a registry name (pulled on first use), a local Hugging Face folder or a hub
    id (only where a hub is reachable). ``dtype`` defaults to float32: the exactness
    contract (captured rows reproduce the model's own attention to 1e-5) is stated in it.
    ``attn_implementation``: ``"eager"`` (capture), the registered name of evictlab's ragged
    attention (the decode loop: ``register_ragged_attention()``) or ``"sdpa"`` (see the
    module docstring).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    impl = check_attn_implementation(attn_implementation)
    dev = check_device(device)
    kind, where = resolve(name)
    local = kind != "hub"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(where), attn_implementation=impl, dtype=dtype, local_files_only=local,
        )
        tok = AutoTokenizer.from_pretrained(str(where), local_files_only=local)
    except OSError as exc:
        if kind == "hub":
            raise InputError("--model", f"could not load hub id {name!r} ({exc.__class__.__name__})",
                             f"use one of: {known_names()}, a local Hugging Face folder, or check the hub is reachable") from None
        fix = (f"delete {where} and run `evictlab models pull {name}`" if kind == "registry"
               else "check the folder holds a complete Hugging Face model")
        raise CorruptFileError(str(where), f"could not load the model ({exc})", fix) from None
    except Exception as exc:  # safetensors, json and torch raise assorted types on bad files
        if kind == "hub":
            raise
        if kind == "registry":
            raise CorruptFileError(str(where), f"could not load the model ({exc})",
                                   f"delete {where} and run `evictlab models pull {name}`") from None
        raise bad_weights(Path(where), exc) from None
    model.to(dev)
    model.eval()
    return model, tok


def bad_weights(folder: Path, exc: BaseException) -> CorruptFileError:
    """The one-line error for a local model folder whose files could not be loaded: the
    weights file when the failure is a damaged safetensors file or a pickle that torch's
    safe loader refuses (a blocked global: such a checkpoint could run code, and evictlab
    never unpickles it unsafely), else the folder."""
    kind = type(exc).__name__
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else kind
    if "Unpickl" in kind or "weights_only" in str(exc) or "GLOBAL" in str(exc):
        files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt")) + sorted(folder.glob("*.pth"))
        where = files[0] if len(files) == 1 else folder
        # the line naming the blocked global (torch's message also suggests weights_only=False: never)
        why = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln.lower()),
                   "a global its safe loader blocks")[:200]
        return CorruptFileError(str(where), f"holds a pickled checkpoint that torch will not load safely ({why})",
                                "use the model's safetensors weights from a trusted copy (a pickle with such "
                                "globals can run code; evictlab never loads one unsafely)")
    if "Safetensor" in kind:
        files = sorted(folder.glob("*.safetensors"))
        where = files[0] if len(files) == 1 else folder
        return CorruptFileError(str(where), f"is not a readable safetensors file ({text})",
                                "replace it with an intact copy of the model's weights")
    return CorruptFileError(str(folder), f"could not load the model ({kind}: {text})",
                            "check the folder holds a complete Hugging Face model (config.json, weights, tokenizer)")


def check_device(device: str) -> "torch.device":
    """Parse ``--device``; InputError when CUDA is asked for but not available."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError("--device", f"unknown device {device!r}", "use cpu or cuda (or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device", "CUDA was requested but torch sees no GPU", "use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise InputError("--device", f"device type {dev.type!r} is not supported", "use cpu or cuda")
    return dev



# --------------------------------------------------------------------------- per-process cache

#: Models loaded by this process: (name, device) -> [model, tokenizer, weights digest or None],
#: least recently used first.
_LOADED: "dict[tuple[str, str, str], list[Any]]" = {}
_LOADED_LOCK = threading.Lock()
#: How many models one process keeps loaded (a remote worker runs tasks of one or two models).
CACHE_SIZE = 2


def load_cached(name: str, device: str = "cpu", attn_implementation: str = "eager") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of :func:`load_model`, loaded once per process, device and
    ``attn_implementation`` (eager for capture, the ragged attention for the decode loop and the grid; the
    :data:`CACHE_SIZE` most recently used are kept; thread-safe): the one model cache of
    every long-running command (a grid run, a remote worker that runs many tasks of one
    model)."""
    key = (name, device, attn_implementation)
    with _LOADED_LOCK:
        hit = _LOADED.pop(key, None)
        if hit is not None:
            _LOADED[key] = hit  # most recent last
            return hit[0], hit[1]
    model, tok = load_model(name, device=device, attn_implementation=attn_implementation)  # outside the lock: loads take seconds
    with _LOADED_LOCK:
        _LOADED[key] = [model, tok, None]
        while len(_LOADED) > CACHE_SIZE:
            _LOADED.pop(next(iter(_LOADED)))
    return model, tok


def clear_loaded() -> None:
    """Forget the models :func:`load_cached` holds in this process."""
    with _LOADED_LOCK:
        _LOADED.clear()


def weights_digest(model: Any) -> str:
    """SHA-256 (16 hex digits) of every parameter and buffer of ``model`` (names, dtypes,
    shapes and bytes, in ``state_dict`` order): two processes that loaded the same weights
    get the same digest, whichever node or cache they loaded them from. Cached for models
    held by :func:`load_cached`."""
    import hashlib

    import torch

    for hit in _LOADED.values():
        if hit[0] is model and hit[2] is not None:
            return hit[2]
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    digest = h.hexdigest()[:16]
    for hit in _LOADED.values():
        if hit[0] is model:
            hit[2] = digest
    return digest
