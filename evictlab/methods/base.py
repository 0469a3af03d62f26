"""The contract between eviction methods and the KV store / decode loop.

A *scorer* looks at one layer's held keys (and the queries that just attended to them) and
returns one importance score per (batch item, KV head, key): higher = keep. An *allocator*
(:class:`Allocator`) turns per-cell scores, held lengths, floors and the budget
(:class:`AllocInputs`) into a number of kept entries per cell, where a cell is one
(layer, KV head); :func:`check_sizes` enforces the one allocation rule.
:func:`select_keep` turns scores and sizes into kept indices.

GQA: storage is per KV head, so the ``q_heads // kv_heads`` query heads of a group share one
kept set. Every scorer reduces its per-query-head statistics to one score per KV head and
documents how (:func:`evictlab.kv.attention.combine_groups` does the reduction; the default
is the mean of the per-head attention probabilities).

Tensor shapes used throughout (``b`` batch, ``hq`` query heads, ``hk`` KV heads, ``s`` held
keys, ``q`` queries, ``d`` head dim):

    keys, values  (b, hk, s, d)      queries (b, hq, q, d)      scores (b, hk, s)
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

from evictlab.errors import InputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.models.geometry import ModelGeometry

__all__ = [
    "AllocInputs",
    "WindowProfile",
    "AllocationError",
    "Allocator",
    "Phase",
    "NEEDS",
    "check_sizes",
    "ScoreInputs",
    "Scorer",
    "keep_order",
    "select_keep",
    "select_keep_ordered",
]


@dataclass
class ScoreInputs:
    """Everything a scorer may use for ONE layer at one compression call.

    Query-agnostic by construction: ``queries`` are those of the chunk just processed (the
    context), never the question. ``extra_queries`` is the one labelled exception: the
    queries of a KVzip reconstruction pass (``needs={"reconstruction"}``) or the true future
    queries for the oracle (``needs={"future"}``).

    Attributes:
        layer: index of this layer, ``0 <= layer < n_layers``.
        n_layers: number of layers of the model.
        keys: ``(b, hk, s, d)`` post-RoPE keys currently held for this layer.
        values: ``(b, hk, s, d)`` the matching values.
        positions: ``(s,)`` int64 absolute token positions of those keys, ascending (every
            store holds a cell's entries in position order); ``(b, s)``, one row per batch
            item, only for scorers that say they accept it (SnapKV, StreamingLLM).
        queries: ``(b, hq, q, d)`` post-RoPE queries of the chunk just processed; the
            observation window is its tail.
        q_positions: ``(q,)`` int64 absolute positions of those queries.
        scaling: the attention module's logit scale (usually ``d ** -0.5``).
        extra_queries: ``(b, hq, m, d)`` or None; reconstruction-pass or future queries,
            all at positions after every held key.
        state: per-layer persistent scorer state (e.g. H2O's accumulated attention), owned
            by the decode loop and passed back unchanged on the next call for this layer.
        cell: ``(batch item, KV head)`` of the run's cache that ``keys`` (then
            ``(1, 1, s, d)``) belong to, when the loop scores one cell at a time (it does);
            None when ``keys`` cover every batch item and KV head in order. Scorers that
            read per-entry data kept beside the cache (TrimKV's ``log beta``) need it.
    """

    layer: int
    n_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    q_positions: torch.Tensor
    scaling: float
    extra_queries: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)
    cell: tuple[int, int] | None = None


NEEDS: frozenset[str] = frozenset({"reconstruction", "future", "gates", "labels"})
"""What a scorer may need from the decode loop beyond held keys and recent queries (see
:class:`Scorer`); the loop reads them from :class:`~evictlab.methods.method.Method`."""


class Scorer(ABC):
    """A key-importance method: ``score(inputs) -> (b, hk, s)`` float32, higher = keep.

    Subclasses are dataclasses whose fields are the method's parameters (validated in
    ``__post_init__`` with an :class:`InputError` naming the parameter), and declare what
    they need as class attributes, which :class:`~evictlab.methods.method.Method` reads once:

    - ``name: ClassVar[str]``: the registry name;
    - ``needs: ClassVar[frozenset[str]]`` (default empty), from :data:`NEEDS`:
      ``"reconstruction"`` (KVzip: run a context-reconstruction pass, built by
      :meth:`reconstruction_ids`, and pass its queries as ``extra_queries``), ``"future"``
      (oracle: pass the true future queries), ``"gates"`` (TrimKV: the scorer records data
      during every forward, :meth:`attach`), ``"labels"`` (the label ORACLE: the task's
      useful-token positions);
    - ``uses_all_queries: ClassVar[bool]`` (default False): True passes as ``queries``
      every query processed since this scorer's previous call for the layer (H2O
      accumulates them; Compactor and ExpectedAttention use the whole chunk); False only the
      last ``window`` queries (SnapKV's observation window).

    Overridable methods with defaults: :meth:`score_cells` (many cells in fewer calls),
    :meth:`attach` (hooks during every forward; nothing by default), :meth:`check_weights`
    (checks against the loaded weights; nothing by default).
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    uses_all_queries: ClassVar[bool] = False

    @abstractmethod
    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Scores ``(b, hk, s)`` float32 of the held keys of ``inputs``, higher = keep."""

    def score_cells(self, cells: Sequence[ScoreInputs]) -> list[torch.Tensor]:
        """Exactly ``[self.score(c) for c in cells]``; a scorer may compute it in fewer
        calls (the decode loop passes the single-item cells of one layer together; SnapKV
        stacks them)."""
        return [self.score(c) for c in cells]

    def load(self) -> Scorer:
        """Read the files the parameters name (TrimKV's gates folder) and return self; the
        registry's factory calls it once after building the dataclass, whose construction
        reads nothing. Default: nothing to read."""
        return self

    def check_weights(self, model: torch.nn.Module) -> None:
        """Checks that need the loaded model's weights, not only its geometry (TrimKV with
        ``gates=default``: shipped gates for these weights exist); :class:`InputError`
        (``scorer_param``) otherwise. Runs before any work is written. Default: nothing."""

    def reconstruction_ids(self, chunk: torch.Tensor, tokenizer: Any) -> torch.Tensor:
        """Token ids ``(b, p + n)`` of the reconstruction pass over ``chunk`` ``(b, n)`` for a
        scorer that ``needs`` ``"reconstruction"`` (``tokenizer.encode(text,
        add_special_tokens=False)`` tokenises a prompt). Default: the chunk again."""
        return chunk

    def record_context(self, model: torch.nn.Module, cache: Any, hidden: list[torch.Tensor] | None) -> None:
        """For a scorer that ``needs`` ``"gates"`` (it records data during every forward):
        record what :meth:`attach` would have recorded for a context that was prefilled
        elsewhere and injected into ``cache`` (:mod:`evictlab.decode.shared`), from that
        context's per-layer attention inputs ``hidden`` ``(b, n, hidden_size)``. Called
        inside :meth:`attach`. Default: nothing to record."""

    def attach(self, model: torch.nn.Module, cache: Any) -> contextlib.AbstractContextManager[None]:
        """Hooks this scorer needs during every forward of an evicting run (TrimKV records
        each appended token's ``log beta``); the decode loop enters it once per scorer
        object around the whole run, inside the cache's own hooks. Default: none."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class WindowProfile:
    """The observation window's dropped-mass statistic per cell, at one compression.

    What ContourKV's online mode reads (an allocator asks for it with ``needs =
    {"window_profile"}``; the decode loop computes it only then, with
    :func:`evictlab.contour.profile.window_stats`). The window's rows are the last
    ``window`` queries (the scorers' observation window) x the group's query heads of a
    cell, each attending, causally, over the cell's held keys.

    Attributes:
        tail: per layer ``l``, float64 ``(batch, kv_heads, S_l + 1)``: entry ``b`` is the mean
            over the window's rows of the attention mass outside the row's ``b`` largest
            masses (``b = 0..length``; ``tail[..., 0] = 1``; 0 past a cell's length).
        entropy_norm: float64 ``(batch, n_layers, kv_heads)``: mean over the same rows of
            ``H(p) / log(n)`` (``n`` = keys the row sees; 0 when ``n <= 1``).
        ranked: per layer, float64 ``(batch, kv_heads, S_l + 1)`` or None: entry ``b`` is the
            mean over the same rows of the mass outside the first ``b`` entries of the
            *scorer's* keep order (:func:`keep_order`: the always-kept entries, then the
            scores, best first), i.e. the dropped mass ``D(A)`` of the set ``A`` that
            :func:`select_keep` keeps at size ``b`` (for ``b >= sinks + recent``). Computed
            when an allocator ``needs`` ``"window_ranked"``.
        error: per layer, float64 ``(batch, kv_heads, S_l + 1)`` or None: the mean forced
            error ``e(A) = ||o - o_A||`` of the same sets (value units; ``o_A`` = 0 when a row
            sees none of ``A``). Computed when an allocator ``needs`` ``"window_error"``.
    """

    tail: tuple[np.ndarray, ...]
    entropy_norm: np.ndarray
    ranked: tuple[np.ndarray, ...] | None = None
    error: tuple[np.ndarray, ...] | None = None


Phase = Literal["prefill", "question", "decode"]
"""When a compression runs: after a context chunk (``"prefill"``), after the chunk that
held question tokens (``"question"``: query-aware runs only), or during decoding."""


@dataclass(frozen=True)
class AllocInputs:
    """Everything an allocator may use at one compression of one batch of sequences.

    A cell is one (layer, KV head); all batch items of a cell hold the same number of
    entries (the store keeps one size per cell for the whole batch).

    Attributes:
        scores: per layer ``l``, ``(batch, kv_heads, S_l)`` float scores of the held
            entries, higher = keep (the scorer's output), ``S_l`` = the layer's longest
            cell. Slots ``j >= lengths[l, h]`` are padding: their value means nothing
            (the decode loop writes the float32 minimum); use ``lengths``.
        lengths: int64 ``(n_layers, kv_heads)``, entries each cell holds now.
        floors: int64 ``(n_layers, kv_heads)``, entries each cell must keep (the sinks and
            the recency window :func:`select_keep` always keeps), clipped to the cell's
            length and to ``window - 1`` on sliding layers.
        windows: per layer, the sliding window ``w`` or None (full attention).
        budget: kept entries per sequence, summed over cells (the :class:`~evictlab.kv.
            budget.Budget` in tokens).
        phase: when this compression runs (:data:`Phase`).
        positions: per layer ``(batch, kv_heads, S_l)`` int64 absolute token positions of
            the held entries, ``-1`` on padding; None when the caller has none.
        next_position: absolute position ``t`` of the next token (every held position is
            ``< t``; ``t - positions`` is an entry's age). None when unknown.
        head_dim: per-head size ``d`` (bytes of one entry = ``2 x d x dtype_bytes``); None
            when unknown (hand-made inputs).
        dtype_bytes: bytes per K/V element; None when unknown.
        geometry: the model's :class:`~evictlab.models.geometry.ModelGeometry` when the
            decode loop runs the allocator (None for hand-made inputs), for allocators that
            must check a fitted profile against the model.
        window: the observation window's :class:`WindowProfile`, when the allocator
            ``needs`` it (None otherwise).
        sinks, recent: the always-kept entries of :func:`select_keep` (the ``sinks``
            oldest and ``recent`` newest entries of every cell; the stores hold a cell's
            entries in position order, so these are its first and last indices); None when
            unknown (hand-made inputs). Allocators that rank individual entries (``global``)
            use them to know which entries a cell keeps whatever its scores.

    The rule every allocator obeys (checked by :func:`check_sizes`): sizes are int64
    ``(n_layers, kv_heads)`` summing exactly to :attr:`target` = ``min(budget, everything
    held)``, with ``floors <= sizes <= lengths`` in every cell.
    """

    scores: tuple[torch.Tensor, ...]
    lengths: np.ndarray
    floors: np.ndarray
    windows: tuple[int | None, ...]
    budget: int
    phase: Phase = "prefill"
    positions: tuple[torch.Tensor, ...] | None = None
    next_position: int | None = None
    head_dim: int | None = None
    dtype_bytes: int | None = None
    geometry: ModelGeometry | None = None
    window: WindowProfile | None = None
    sinks: int | None = None
    recent: int | None = None

    def __post_init__(self) -> None:
        n, hk = self.lengths.shape if self.lengths.ndim == 2 else (-1, -1)
        if n < 1 or self.lengths.dtype != np.int64 or self.floors.dtype != np.int64:
            raise InputError("lengths", f"expected int64 (n_layers, kv_heads), got {self.lengths.dtype} "
                             f"{self.lengths.shape} (floors {self.floors.dtype})", "pass int64 arrays")
        if self.floors.shape != self.lengths.shape:
            raise InputError("floors", f"shape {self.floors.shape}, lengths {self.lengths.shape}",
                             "pass one floor per cell")
        if len(self.scores) != n or len(self.windows) != n:
            raise InputError("scores", f"{len(self.scores)} score layers and {len(self.windows)} windows for "
                             f"{n} layers", "pass one score tensor and one window per layer")
        for l, sc in enumerate(self.scores):
            if sc.ndim != 3 or sc.shape[1] != hk:
                raise InputError(f"scores[{l}]", f"shape {tuple(sc.shape)}, expected (batch, {hk}, seq)",
                                 "pass per-KV-head scores (combine GQA groups first)")
            if sc.shape[2] < int(self.lengths[l].max()):
                raise InputError("lengths", f"layer {l}: a cell holds {int(self.lengths[l].max())} entries but the "
                                 f"scores cover {sc.shape[2]}", "pass lengths no longer than each layer's scores")
            if self.positions is not None and tuple(self.positions[l].shape) != tuple(sc.shape):
                raise InputError(f"positions[{l}]", f"shape {tuple(self.positions[l].shape)} differs from the "
                                 f"scores' {tuple(sc.shape)}", "pass positions laid out like the scores")
        if (self.lengths < 0).any() or (self.floors < 0).any() or (self.floors > self.lengths).any():
            raise InputError("floors", "must satisfy 0 <= floors <= lengths in every cell",
                             "clip the floors to the cells' lengths")
        if int(self.budget) < int(self.floors.sum()):
            raise InputError("budget", f"{self.budget} is below the total floor {int(self.floors.sum())} "
                             f"({self.floors.size} cells x min(sinks + recent, length))",
                             "raise the budget or lower sinks/recent")
        if self.phase not in ("prefill", "question", "decode"):
            raise InputError("phase", f"unknown phase {self.phase!r}", "use prefill, question or decode")
        if self.window is not None:
            w = self.window
            if len(w.tail) != n or np.shape(w.entropy_norm)[1:] != (n, hk):
                raise InputError("window", f"{len(w.tail)} tail layers and entropy {np.shape(w.entropy_norm)} for "
                                 f"{n} layers x {hk} KV heads", "pass one (batch, kv_heads, S_l + 1) array per layer")
            for what, arrays in (("tail", w.tail), ("ranked", w.ranked), ("error", w.error)):
                if arrays is None:
                    continue
                if len(arrays) != n:
                    raise InputError(f"window.{what}", f"{len(arrays)} layers for {n}", "pass one array per layer")
                for l, t in enumerate(arrays):
                    if t.ndim != 3 or t.shape[1] != hk or t.shape[2] < int(self.lengths[l].max()) + 1:
                        raise InputError(f"window.{what}[{l}]", f"shape {t.shape}, expected (batch, {hk}, >= "
                                         f"{int(self.lengths[l].max()) + 1})", "pass b = 0..length for every cell")
        if (self.sinks is None) != (self.recent is None) or min(self.sinks or 0, self.recent or 0) < 0:
            raise InputError("sinks", f"sinks={self.sinks}, recent={self.recent}",
                             "pass both as integers >= 0, or neither")

    @classmethod
    def build(
        cls,
        scores: Sequence[torch.Tensor | np.ndarray] | np.ndarray,
        budget: int,
        *,
        floor: int = 0,
        lengths: np.ndarray | None = None,
        windows: Sequence[int | None] | None = None,
        **kw: Any,
    ) -> AllocInputs:
        """Inputs from per-layer scores ``(batch, hk, s_l)`` or ``(hk, s_l)`` (or one
        ``(n_layers, hk, s)`` array), one ``floor`` for every cell (clipped to each cell's
        length and to ``window - 1`` on sliding layers). ``lengths`` defaults to each
        layer's last axis. Other fields by keyword."""
        layers = []
        for x in scores:
            t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
            layers.append(t[None] if t.ndim == 2 else t)
        hk = layers[0].shape[1] if layers else 0
        if lengths is None:
            lengths = np.array([[t.shape[-1]] * hk for t in layers], dtype=np.int64).reshape(len(layers), hk)
        lengths = np.asarray(lengths, dtype=np.int64)
        windows = tuple(windows) if windows is not None else (None,) * len(layers)
        if floor < 0:
            raise InputError("floor", f"{floor} is negative", "pass sinks + recent >= 0")
        floors = np.minimum(floor, lengths)
        if len(windows) == floors.shape[0]:  # else __post_init__ refuses the windows
            cap = np.array([[w - 1 if w else np.iinfo(np.int64).max] for w in windows], dtype=np.int64)
            floors = np.minimum(floors, cap)
        return cls(tuple(layers), lengths, floors.astype(np.int64), windows, int(budget), **kw)

    @property
    def n_layers(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.lengths.shape[1])

    @property
    def held(self) -> int:
        """Entries held now, summed over cells."""
        return int(self.lengths.sum())

    @property
    def target(self) -> int:
        """What the sizes must sum to: the budget, or everything held when that is less."""
        return min(int(self.budget), self.held)

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one kept entry of one cell (K and V); InputError if the inputs lack them."""
        if self.head_dim is None or self.dtype_bytes is None:
            raise InputError("head_dim", "the entry size is unknown (no head_dim / dtype_bytes given)",
                             "pass head_dim= and dtype_bytes= (the decode loop always does)")
        return 2 * int(self.head_dim) * int(self.dtype_bytes)

    def layer_scores(self) -> list[np.ndarray]:
        """Per layer, float64 ``(kv_heads, S_l)`` scores averaged over the batch (NaN refused)."""
        out = []
        for l, x in enumerate(self.scores):
            a = x.detach().to("cpu", torch.float64).numpy().mean(axis=0)
            if np.isnan(a).any():
                raise InputError(f"scores[{l}]", "contains NaN", "fix the scorer")
            out.append(a)
        return out


class AllocationError(RuntimeError):
    """An allocator returned sizes that break the allocation rule (a bug in the allocator)."""


def check_number(value: object, name: str) -> float:
    """``value`` as a float, or :class:`InputError` naming parameter ``name`` (a bool is no number):
    the allocators' check of a numeric parameter built directly, not through the registry's parsing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(name, f"{value!r} is not a number", f"pass a number for {name}")
    return float(value)


def check_sizes(inputs: AllocInputs, sizes: np.ndarray, who: str = "allocator") -> np.ndarray:
    """Enforce the allocation rule on ``sizes``; return them as int64 ``(n_layers, kv_heads)``.

    The rule: the sizes sum exactly to ``inputs.target`` (the budget, or everything held
    when that is less) and ``inputs.floors <= sizes <= inputs.lengths`` in every cell.
    Raises :class:`AllocationError` naming ``who`` otherwise.
    """
    arr = np.asarray(sizes)
    if arr.shape != inputs.lengths.shape or not np.issubdtype(arr.dtype, np.integer):
        raise AllocationError(f"{who} returned {arr.dtype} sizes of shape {arr.shape}, expected int64 "
                              f"{inputs.lengths.shape}")
    arr = arr.astype(np.int64)
    if int(arr.sum()) != inputs.target:
        raise AllocationError(f"{who} returned sizes summing to {int(arr.sum())}, expected {inputs.target} "
                              f"(budget {inputs.budget}, held {inputs.held})")
    if (arr < inputs.floors).any() or (arr > inputs.lengths).any():
        raise AllocationError(f"{who} returned sizes outside [floors, lengths] in some cell")
    return arr


@dataclass(frozen=True)
class Allocator(ABC):
    """A per-cell budget method: ``allocate(inputs) -> sizes``.

    Subclasses are frozen dataclasses whose fields are the method's parameters, validated
    in ``__post_init__`` (an :class:`InputError` naming the parameter), with a class-level
    ``name`` (the registry name). ``allocate`` returns int64 ``(n_layers, kv_heads)`` kept
    entries per cell obeying the rule of :class:`AllocInputs` (see :func:`check_sizes`).
    """

    name: ClassVar[str] = ""

    @property
    def needs(self) -> frozenset[str]:
        """Extra inputs the decode loop must compute for this allocator: ``"window_profile"``
        (:attr:`AllocInputs.window`). Empty by default: nothing extra is computed."""
        return frozenset()

    def check(self, geometry: ModelGeometry) -> None:
        """Refuse a model this allocator cannot serve (:class:`InputError`), before a run
        starts; e.g. a profile fitted on another geometry. Default: any model."""

    def load(self) -> Allocator:
        """Read the files the parameters name (a fitted profile, a predictor) and return
        self; the registry's factory calls it once after building the dataclass, whose
        construction reads nothing. Default: nothing to read."""
        return self

    @abstractmethod
    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        """Kept entries per cell, int64 ``(n_layers, kv_heads)``."""


def select_keep(
    scores: torch.Tensor,
    sizes: torch.Tensor | np.ndarray | list[int],
    positions: torch.Tensor,
    *,
    sinks: int,
    recent: int,
) -> list[list[torch.Tensor]]:
    """Kept key indices per batch item and KV head.

    For KV head ``h`` the kept set has ``min(sizes[h], s)`` keys: first the ``sinks`` keys
    with the smallest positions and the ``recent`` keys with the largest positions (always
    kept), then the highest scores among the rest. Equal scores prefer the more recent key
    (larger position), and equal positions the larger index, so the result is deterministic.

    Args:
        scores: ``(b, hk, s)``, higher = keep; NaN is rejected.
        sizes: ``(hk,)`` int, kept tokens per KV head (the allocator's row for this layer).
        positions: ``(s,)`` int64 absolute positions of the keys.
        sinks: number of attention-sink tokens always kept.
        recent: size of the recency window always kept.

    Returns:
        ``keep[i][h]``: int64 tensor of sorted indices into the ``s`` axis, on ``scores``'
        device.

    Raises:
        InputError: when a size is below the forced ``sinks + recent`` keys (clipped to
            ``s``), or the shapes disagree.
    """
    if scores.ndim != 3:
        raise InputError("scores", f"expected (batch, kv_heads, seq), got shape {tuple(scores.shape)}",
                         "pass one score per batch item, KV head and held key")
    b, hk, s = scores.shape
    sizes_t = torch.as_tensor(np.asarray(sizes, dtype=np.int64)).reshape(-1)
    if sizes_t.numel() != hk:
        raise InputError("sizes", f"{sizes_t.numel()} sizes for {hk} KV heads", "pass one size per KV head")
    if positions.shape != (s,):
        raise InputError("positions", f"shape {tuple(positions.shape)} for {s} keys", "pass (seq,) positions")
    if torch.isnan(scores).any():
        raise InputError("scores", "contains NaN", "fix the scorer; scores must be finite or +-inf")
    device = scores.device
    pos = positions.to(device)
    n_forced = min(s, sinks + recent)
    if (sizes_t < n_forced).any():
        raise InputError("sizes", f"a head's size {int(sizes_t.min())} is below the {n_forced} "
                         f"always-kept keys (sinks={sinks}, recent={recent})",
                         "raise the budget or lower --sinks/--recent (allocators take floor=sinks+recent)")
    if s > 1 and bool((pos[1:] > pos[:-1]).all()):
        return select_keep_ordered(scores, sizes_t, sinks=sinks, recent=recent)
    # Rank keys by position once: the sinks are the oldest, the window the newest.
    by_pos = torch.argsort(pos, stable=True)
    forced = torch.zeros(s, dtype=torch.bool, device=device)
    forced[by_pos[: min(sinks, s)]] = True
    if recent > 0:
        forced[by_pos[max(0, s - recent):]] = True
    # Tie-break order: larger position first, then larger index (a total order on keys).
    recency_order = torch.argsort(pos * (s + 1) + torch.arange(s, device=device), descending=True)
    keep: list[list[torch.Tensor]] = []
    for i in range(b):
        per_head = []
        for h in range(hk):
            k = min(int(sizes_t[h]), s)
            sc = scores[i, h, recency_order].float()
            # Two stable sorts give the lexicographic order (forced, score, recency): a
            # +inf score never outranks a forced key, and ties keep the recency order.
            by_score = torch.sort(sc, descending=True, stable=True).indices
            is_forced = forced[recency_order][by_score].to(torch.int8)
            order = by_score[torch.sort(is_forced, descending=True, stable=True).indices]
            chosen = recency_order[order[:k]]
            per_head.append(torch.sort(chosen).values)
        keep.append(per_head)
    return keep


def keep_order(scores: torch.Tensor, *, sinks: int, recent: int) -> torch.Tensor:
    """The order in which :func:`select_keep_ordered` keeps a cell's entries, best first.

    Args:
        scores: ``(s,)`` the scores of one cell's held entries, in position order.
        sinks, recent: the always-kept entries (the first ``sinks``, the last ``recent``).

    Returns:
        int64 ``(s,)`` indices: the always-kept entries (in index order), then the others by
        score descending, equal scores to the larger index. For every size ``b >= min(s,
        sinks + recent)`` the first ``b`` of them, sorted, are exactly what
        ``select_keep_ordered`` keeps at size ``b``: so a statistic read along this order at
        ``b`` is the statistic of the kept set (ContourKV's scorer-ranked profiles).
    """
    s = scores.shape[-1]
    if scores.ndim != 1:
        raise InputError("scores", f"expected (seq,), got shape {tuple(scores.shape)}", "pass one cell's scores")
    lo, hi = min(sinks, s), max(min(sinks, s), s - recent)
    device = scores.device
    edges = torch.cat([torch.arange(lo, device=device), torch.arange(hi, s, device=device)])
    order = torch.sort(scores[lo:hi].flip(-1).float(), descending=True, stable=True).indices
    return torch.cat([edges, (hi - 1) - order]).to(torch.int64)


def select_keep_ordered(
    scores: torch.Tensor, sizes: torch.Tensor | np.ndarray | list[int], *, sinks: int, recent: int,
) -> list[list[torch.Tensor]]:
    """:func:`select_keep` for cells whose keys are held in position order (what every
    store holds: index order = position order, so no positions are needed), for all heads
    of ``scores`` ``(b, hk, s)`` at once. The sinks are the first ``sinks`` indices, the
    recency window the last ``recent``, and "more recent" is "larger index", so one stable
    sort of the middle keys (reversed, so equal scores go to the larger index) ranks them.
    Same result as :func:`select_keep` with ascending positions (it delegates here)."""
    b, hk, s = scores.shape
    sizes_t = torch.as_tensor(np.asarray(sizes, dtype=np.int64)).reshape(-1)
    if sizes_t.numel() != hk:
        raise InputError("sizes", f"{sizes_t.numel()} sizes for {hk} KV heads", "pass one size per KV head")
    if (sizes_t < min(s, sinks + recent)).any():
        raise InputError("sizes", f"a head's size {int(sizes_t.min())} is below the {min(s, sinks + recent)} "
                         f"always-kept keys (sinks={sinks}, recent={recent})", "raise the budget or lower sinks/recent")
    if torch.isnan(scores).any():
        raise InputError("scores", "contains NaN", "fix the scorer; scores must be finite or +-inf")
    lo, hi = min(sinks, s), max(min(sinks, s), s - recent)  # middle keys: [lo, hi)
    device = scores.device
    edges = torch.cat([torch.arange(lo, device=device), torch.arange(hi, s, device=device)])
    # Middle keys newest first; a stable descending sort keeps that order among equal scores.
    order = torch.sort(scores[:, :, lo:hi].flip(-1).float(), dim=-1, descending=True, stable=True).indices
    picked = (hi - 1) - order  # back to key indices, best first
    keep: list[list[torch.Tensor]] = []
    for i in range(b):
        per_head = []
        for h in range(hk):
            extra = max(0, min(int(sizes_t[h]), s) - edges.numel())
            per_head.append(torch.sort(torch.cat([edges, picked[i, h, :extra]])).values)
        keep.append(per_head)
    return keep
