"""ContourKV (ours): per-cell budgets from dropped-mass profiles, spent along one level.

Definition (``docs/theory.md`` section 10.1; ours, from the paper's description): each cell
``c`` = (layer, KV head) has a dropped-mass profile ``D_c(b)``, the mean attention mass
outside a row's top-``b`` keys (:mod:`evictlab.contour.profile`). For a budget ``B`` the
level ``tau`` is chosen with ``sum_c b_c(tau) = B``, where

    b_c(tau) = floor_c + min{b : D_c(b) <= tau}      (capped at the cell's length, and at
                                                       window - 1 on sliding layers)

and ``floor_c`` = sinks + recency window (what :func:`~evictlab.methods.base.select_keep`
always keeps). A flat cell (its mass spread over many keys: large ``D_c`` at a given ``b``)
needs many entries to reach the level; a peaked one few. The integer total is exact: the
level search (:mod:`evictlab.contour.level`) takes the ``E = target - sum floors`` largest
priorities ``D_c(k - 1)``, ties at the final level broken deterministically (k, then cell).

Two ways to get the profiles:

* ``profile=PROFILE.json`` (offline): fitted from captured rows by ``evictlab contour fit``;
  relative budgets ``r = b / n`` are read at ``n`` = the tokens seen so far (the window on
  sliding layers), i.e. ``D_c(b) = profile_c(b / n)``;
* no profile (online): the decode loop measures the observation window's rows over each
  cell's held keys at every compression (:class:`~evictlab.methods.base.WindowProfile`).

``contourkv_pred`` weights the profile by a fitted dropped-mass predictor
(``evictlab predictor fit``): the level runs on ``D_c(b) * q_c(b)``, with ``q_c(b)`` the
predicted probability that a row of cell ``c`` has a significant selection gap at budget
``b`` (``kappa_hat > threshold``), the features taken from the cell's profile at ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from evictlab.contour.level import envelope, min_sum_increments, top_increments
from evictlab.errors import InputError
from evictlab.methods.base import AllocInputs, Allocator, check_number

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.contour.profile import ContourProfile
    from evictlab.models.geometry import ModelGeometry
    from evictlab.stats.predictors import Predictor

__all__ = ["ContourKV", "ContourKVError", "ContourKVMass", "ContourKVOffline", "ContourKVPred", "ContourKVQuery"]


def _load_profile(path: Path) -> ContourProfile:
    from evictlab.contour.profile import ContourProfile

    try:
        return ContourProfile.load(path)
    except InputError as exc:  # name the parameter; the problem names the file
        raise InputError("profile", f"{exc.field}: {exc.problem}", exc.fix) from None


Ranking = Literal["scorer", "query"]
Objective = Literal["level", "mass", "error"]


def _dense(x: np.ndarray, y: np.ndarray, nk: np.ndarray, K: int) -> np.ndarray:
    """Knot curves ``(cells, G)`` read at ``b = 0..K-1``, float64 ``(cells, K)``: the same
    linear interpolation (and clamping) as the level search's priorities."""
    b = np.arange(K, dtype=np.float64)
    out = np.empty((x.shape[0], K))
    for c in range(x.shape[0]):
        xs, ys = x[c, :nk[c]], y[c, :nk[c]]
        j = np.clip(np.searchsorted(xs, b, side="right") - 1, 0, nk[c] - 1)
        j1 = np.minimum(j + 1, nk[c] - 1)
        inner = (j < nk[c] - 1) & (b > xs[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            lin = ys[j] + (ys[j1] - ys[j]) * ((b - xs[j]) / (xs[j1] - xs[j]))
        out[c] = np.where(inner, lin, np.where(b >= xs[0], ys[j], ys[0]))
    return out


def _geometry_key(geometry: ModelGeometry) -> tuple[Any, ...]:
    return (geometry.n_layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim, tuple(geometry.windows))


@dataclass(frozen=True)
class ContourKV(Allocator):
    """ContourKV: per-cell sizes from dropped-mass profiles (module docstring), one objective.

    Inputs: :class:`AllocInputs` (lengths, floors, windows, budget; ``next_position`` and
    ``geometry`` when the decode loop calls; ``window`` in online mode). Returns int64
    ``(n_layers, kv_heads)`` summing exactly to ``inputs.target``, ``floors <= sizes <=
    caps = min(lengths, window - 1)``. Reads no scores itself: any scorer picks the kept
    keys; with ``ranking="scorer"`` the profile is measured along that scorer's keep order.

    Parameters:

    * ``profile``: a file from ``evictlab contour fit`` (offline; checked against the
      model's geometry before the run), ``default`` (the profile shipped in ``data/contour/``
      for the loaded model, :mod:`evictlab.contour.shipped`), or None (online).
    * ``ranking`` (online): ``scorer`` (default): ``D_c(b)`` is the window rows' mass outside
      the first ``b`` entries of the scorer's keep order, i.e. outside the set the selection
      really keeps at size ``b`` (:func:`~evictlab.methods.base.keep_order`), read at the
      cell's full size ``b = floor_c + k``; ``query``: the mean over rows of the mass outside
      each row's *own* top-``b`` keys (the statistic of a fitted profile, and ContourKV's
      profile before issue 24), read at ``b = k`` above the floor (the floor counted on top).
      None: ``scorer`` online, ``query`` with a profile file (the only one it holds).

    * ``safeguard`` (scorer ranking only; default 0, off): before the objective splits the
      budget, every cell keeps ``min(cap_c, max(floor_c, floor(safeguard * target / cells)))``
      entries, its share of a uniform split (AdaKV's ``alpha``); the objective moves only the
      rest. Why: under the query-agnostic protocol the window sees the end of the context, so
      the objectives can starve a cell the later question reads (Gemma 3's global layers,
      docs/contour.md); the safeguard bounds how far any cell falls below uniform. Exact for
      the scorer ranking, whose curves are read at the cell's whole size; refused with a
      fitted profile or the query ranking, whose curves count the floor on top.

    The objective (a class attribute; each objective is its own registered name): ``level``
    (``contourkv``): minimise ``max_c D_c`` (every cell reaches one level, the E largest
    priorities, :func:`evictlab.contour.level.top_increments`); ``mass``
    (``contourkv_mass``): minimise ``sum_c D_c(b_c)``; ``error`` (``contourkv_error``):
    minimise ``sum_c e_c(b_c)``, the window rows' mean forced error of the scorer's kept
    set (the two summed ones exactly, :func:`evictlab.contour.level.min_sum_increments`).
    """

    profile: Path | None = None
    ranking: Ranking | None = None
    safeguard: float = 0.0
    name: ClassVar[str] = "contourkv"
    objective: ClassVar[Objective] = "level"
    _profile: Any = field(default=None, init=False, repr=False, compare=False)
    _defaults: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ranking is not None and self.ranking not in ("scorer", "query"):
            raise InputError("ranking", f"{self.ranking!r} is not scorer or query", "use ranking=scorer or query")
        if self.profile is not None and self.ranking == "scorer":
            raise InputError("ranking", "a fitted profile holds each row's own top-b dropped mass, not a scorer's "
                             "(the scorer ranks the run's own keys)", "drop ranking= (or ranking=query) with profile=, "
                             "or drop profile= to measure the scorer's ranking online")
        if not 0.0 <= check_number(self.safeguard, "safeguard") <= 1.0:
            raise InputError("safeguard", f"{self.safeguard!r} is not a fraction in [0, 1]",
                             "use e.g. safeguard=0.5 (each cell keeps half its uniform share), or 0 for none")
        if self.safeguard and (self.profile is not None or self.ranked == "query"):
            raise InputError("safeguard", f"{self.name} reads its curves above the floor (a fitted profile or the "
                             "query ranking), where a raised floor is not exact",
                             "use safeguard with the scorer ranking (contourkv, _mass, _error, _relerror online)")
        if self.objective == "error" and self.profile is not None:
            raise InputError("profile", f"{self.name} measures the forced error of the scorer's kept sets online; a "
                             "fitted profile holds no forced error", f"drop profile= for {self.name}")
        if self.objective == "error" and self.ranking == "query":
            raise InputError("ranking", f"{self.name} measures the forced error of the scorer's kept sets",
                             "drop ranking= (or ranking=scorer)")

    @property
    def is_default(self) -> bool:
        """Whether ``profile`` names the shipped profile (``profile=default``)."""
        from evictlab.contour.shipped import DEFAULT

        return self.profile is not None and str(self.profile) == DEFAULT

    @property
    def ranked(self) -> str:
        """The ranking in effect: ``scorer`` or ``query`` (see the class docstring)."""
        return self.ranking or ("query" if self.profile is not None else "scorer")

    def load(self) -> ContourKV:
        """Read the profile file (the registry's factory calls this once, after the
        dataclass is built: construction itself reads nothing). ``profile=default`` is
        resolved per model, in :meth:`check` (the model is not known here)."""
        if self.profile is not None and not self.is_default and self._profile is None:
            object.__setattr__(self, "_profile", _load_profile(Path(self.profile)))
        return self

    @property
    def needs(self) -> frozenset[str]:
        if self.profile is not None:
            return frozenset()
        if self.objective == "error":
            return frozenset({"window_profile", "window_error"})
        return frozenset({"window_profile", "window_ranked"} if self.ranked == "scorer" else {"window_profile"})

    def check(self, geometry: ModelGeometry) -> None:
        if self.profile is not None:
            self._checked(geometry, None)

    def fitted(self, geometry: ModelGeometry | None) -> ContourProfile | None:
        """The fitted profile in use for a model of ``geometry``: the file's, the shipped one
        (``profile=default``; :class:`InputError` for a model none describes, or without a
        geometry), or None online."""
        if not self.is_default:
            return self._profile
        if geometry is None:
            raise InputError("allocator_param", "profile=default picks the shipped profile of the loaded model, "
                             "and these inputs name no model (AllocInputs.geometry is None)",
                             "pass AllocInputs(geometry=...) or profile=PROFILE.json")
        key = _geometry_key(geometry)
        if key not in self._defaults:
            from evictlab.contour.shipped import default_profile

            try:
                self._defaults[key] = self._bind(default_profile(geometry)[1])
            except InputError as exc:
                raise InputError("allocator_param", f"{self.name} parameter profile={exc.problem}", exc.fix) from None
        return self._defaults[key]

    def use_default(self, geometry: ModelGeometry, profile: ContourProfile) -> None:
        """Resolve ``profile=default`` to ``profile`` (held in memory: tests, notebooks) for
        models of ``geometry``, instead of the shipped one; checked against the geometry."""
        try:
            profile.check(geometry, source="profile")
        except InputError as exc:
            raise InputError("allocator_param", f"profile {exc.problem}", exc.fix) from None
        self._defaults[_geometry_key(geometry)] = self._bind(profile)

    def _bind(self, profile: ContourProfile) -> ContourProfile:
        """Hook for a shipped profile once resolved (ContourKVPred reads its predictor)."""
        return profile

    def _checked(self, geometry: ModelGeometry | None, shape: tuple[int, int] | None) -> None:
        prof = self.fitted(geometry)
        try:
            prof.check(geometry, shape, source="profile")
        except InputError as exc:
            raise InputError("allocator_param", f"profile {self.profile} {exc.problem}", exc.fix) from None

    # -- the profiles as knots ---------------------------------------------------------
    def knots(self, inputs: AllocInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every cell's curve as knots ``(x, y, n_knots)``: ``x`` in entries (``b``, the cell's
        size for the scorer ranking, above the floor for the query ranking), ``y`` the
        objective's per-cell quantity (dropped mass, or forced error for ``error``; before
        weighting and the envelope), cells layer-major, float64 ``(cells, K)``."""
        n_layers, hk = inputs.lengths.shape
        prof = self.fitted(inputs.geometry) if self.profile is not None else None
        if prof is not None:
            self._checked(inputs.geometry, (n_layers, hk))
            x, y = prof.knots(self.reference_lengths(inputs))
            return x, y, np.full(x.shape[0], x.shape[1], dtype=np.int64)
        w = inputs.window
        curves = None if w is None else (w.error if self.objective == "error" else
                                         w.ranked if self.ranked == "scorer" else w.tail)
        if curves is None:
            what = {"error": "forced error (window.error)", "level": "", "mass": ""}[self.objective] or (
                "scorer-ranked dropped mass (window.ranked)" if self.ranked == "scorer" else "profile (window.tail)")
            raise InputError("window", f"{self.name} without a profile estimates its profiles from the observation "
                             f"window, which these inputs lack (AllocInputs.window or its {what} is None)",
                             "run it in the decode loop, pass AllocInputs(window=...), or give profile=PROFILE.json")
        lens = inputs.lengths
        K = int(lens.max()) + 1
        x = np.broadcast_to(np.arange(K, dtype=np.float64), (n_layers * hk, K)).copy()
        y = np.zeros((n_layers * hk, K))
        for l, t in enumerate(curves):
            s = min(K, t.shape[2])
            y[l * hk:(l + 1) * hk, :s] = np.asarray(t, dtype=np.float64).mean(axis=0)[:, :s]
        return x, y, (lens.reshape(-1) + 1).astype(np.int64)

    @staticmethod
    def reference_lengths(inputs: AllocInputs) -> np.ndarray:
        """``(n_layers, kv_heads)`` keys a row of each cell sees now, to read relative profiles:
        the tokens seen (``next_position``), at most the window on sliding layers; the cells'
        lengths when the position is unknown (hand-made inputs)."""
        if inputs.next_position is None:
            return np.maximum(inputs.lengths, 1)
        seen = max(int(inputs.next_position), 1)
        per_layer = [min(seen, w) if w else seen for w in inputs.windows]
        return np.repeat(np.array(per_layer, dtype=np.int64)[:, None], inputs.kv_heads, axis=1)

    def weights(self, inputs: AllocInputs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The profile the objective runs on (ContourKV: the dropped mass itself)."""
        return y

    def costs(self, inputs: AllocInputs, caps: np.ndarray) -> np.ndarray:
        """The per-cell objective curves, float64 ``(cells, K)``: entry ``k`` is the cell's
        value when it keeps ``floors_c + k`` entries, ``k = 0..caps_c - floors_c`` (entries
        past that are padding: the last value). Scorer ranking: ``y[floor_c + k]`` (the
        profile is of the cell's whole kept set); query ranking and fitted profiles: the
        curve at ``b = k`` (the floor counted on top, as the level search reads it)."""
        x, y, nk = self.knots(inputs)
        w = self.weights(inputs, x, y)
        if not np.isfinite(w).all():
            raise InputError("window" if self.profile is None else "profile", "the profile holds NaN or inf",
                             "check the observation window's attention (or refit the profile)")
        floors = inputs.floors.reshape(-1)
        room = (caps.reshape(-1) - floors)
        K = int(room.max(initial=0)) + 1
        if self.profile is None and self.ranked == "scorer" or self.objective == "error":
            idx = np.minimum(floors[:, None] + np.arange(K)[None, :], (nk - 1)[:, None])
            return np.take_along_axis(w, idx, axis=1)
        return _dense(x, w, nk, K)

    # -- allocation ----------------------------------------------------------------------
    def safeguarded(self, inputs: AllocInputs, caps: np.ndarray) -> AllocInputs:
        """``inputs`` with every cell's floor raised to ``max(floor_c, min(cap_c, s))``, ``s =
        floor(safeguard * target / cells)`` (class docstring). With the decode loop's floors
        (one value, or a cell's whole cap where it holds less) these sum to at most the target;
        for other hand-made floors ``s`` is lowered to the largest value whose floors fit."""
        floors = inputs.floors

        def raised(share: int) -> np.ndarray:
            return np.maximum(floors, np.minimum(caps, share)).astype(np.int64)

        share = int(self.safeguard * inputs.target / floors.size)
        if int(raised(share).sum()) > inputs.target:  # monotone in share; share = 0 fits
            lo, hi = 0, share
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if int(raised(mid).sum()) <= inputs.target else (lo, mid - 1)
            share = lo
        return replace(inputs, floors=raised(share))

    def caps(self, inputs: AllocInputs) -> np.ndarray:
        """Most entries per cell: its length, at most ``window - 1`` on sliding layers
        (:class:`InputError` when the budget cannot fit under them)."""
        floors, lengths = inputs.floors, inputs.lengths
        caps = lengths.copy()
        for l, w in enumerate(inputs.windows):
            if w is not None:
                caps[l] = np.minimum(caps[l], w - 1)  # a sliding cell never keeps more than w - 1
        if (floors > caps).any() or int(caps.sum()) < inputs.target:
            raise InputError("lengths", f"sliding cells hold entries no later query can attend (caps "
                             f"{int(caps.sum())} < target {inputs.target}, or a floor above window - 1)",
                             "drop entries with pos <= next - window first (the decode loop does)")
        return caps

    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        caps = self.caps(inputs)
        if self.safeguard:
            inputs = self.safeguarded(inputs, caps)
        floors = inputs.floors
        extra = inputs.target - int(floors.sum())
        room = (caps - floors).reshape(-1)
        if self.objective == "level" and not (self.profile is None and self.ranked == "scorer"):
            # the fitted grid or the query tail as knots: the level search reads them lazily
            x, y, nk = self.knots(inputs)
            prio = envelope(self.weights(inputs, x, y))
            if not np.isfinite(prio).all():
                raise InputError("window" if self.profile is None else "profile", "the profile holds NaN or inf",
                                 "check the observation window's attention (or refit the profile)")
            # the knots rise strictly by construction (the fitted grid, or b = 0..length)
            counts = top_increments(x, prio, nk, room, extra, validate=False)
        elif self.objective == "level":
            F = envelope(self.costs(inputs, caps))
            x = np.broadcast_to(np.arange(F.shape[1], dtype=np.float64), F.shape)
            counts = top_increments(x, F, room + 1, room, extra, validate=False)
        else:
            counts = min_sum_increments(self.costs(inputs, caps), room, extra)
        return floors + counts.reshape(floors.shape)


@dataclass(frozen=True)
class ContourKVMass(ContourKV):
    """ContourKV minimising the summed dropped mass ``sum_c D_c(b_c)`` (exact; class docstring
    of :class:`ContourKV`). AdaKV's one threshold does this for attention scores sorted within
    each cell; along a scorer's order the marginal masses are not sorted, so the exact
    integer split is a dynamic programme (:func:`evictlab.contour.level.min_sum_increments`)."""

    name: ClassVar[str] = "contourkv_mass"
    objective: ClassVar[Objective] = "mass"


@dataclass(frozen=True)
class ContourKVError(ContourKV):
    """ContourKV minimising the summed forced error ``sum_c e_c(b_c)`` of the scorer's kept sets
    (online only). ``e_c(b)`` is the window rows' mean ``||o - o_A||`` for the set ``A`` the
    scorer keeps at size ``b``, ``= D(A) ||m_{A^c} - m_A||`` (docs/theory.md): each cell's
    drop weighed by how far its dropped values lie from its kept ones. Prefix sums along the
    keep order give every ``b`` in one pass (:func:`evictlab.contour.profile.ranked_window_stats`)."""

    name: ClassVar[str] = "contourkv_error"
    objective: ClassVar[Objective] = "error"


@dataclass(frozen=True)
class ContourKVRelError(ContourKVError):
    """ContourKV minimising the summed *relative* forced error ``sum_c e_c(b_c) / e_c(0)``:
    each cell's error of the scorer's kept set divided by its error when keeping nothing,
    ``e_c(0)`` = the window rows' mean ``||o||`` (the full-cache output's size in value units),
    so a cell whose values are large does not outweigh the others by their size alone. Why:
    on Gemma 3 the absolute objective (``contourkv_error``) keeps whole windows in layers 0-1,
    whose value-unit errors are 5-10 times the others', and starves the global layers that
    hold the answer; Gemma 3 normalises every attention block's output before the residual
    stream, so only the error relative to the output reaches the network (docs/contour.md).
    A cell with ``e_c(0) = 0`` (no output to lose) costs 0 at every size. Online only."""

    name: ClassVar[str] = "contourkv_relerror"

    def weights(self, inputs: AllocInputs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``y / y[:, 0]`` per cell (``y[:, 0]`` = ``e_c(0)``; 0 where it is 0)."""
        scale = y[:, :1]
        return np.divide(y, scale, out=np.zeros_like(y), where=scale > 0)


@dataclass(frozen=True)
class ContourKVQuery(ContourKV):
    """ContourKV's level on the per-query profile (``ranking=query``): the mean mass outside
    each window row's own top-``b`` keys, the floor counted on top. ContourKV's online default
    before issue 24, kept to compare against the scorer-ranked default."""

    ranking: Ranking | None = "query"
    name: ClassVar[str] = "contourkv_query"


@dataclass(frozen=True)
class ContourKVOffline(ContourKV):
    """ContourKV's level on a fitted profile, by default the one shipped for the loaded model
    (``profile=default``, :mod:`evictlab.contour.shipped`): rows of the same model on other
    text, against the online estimate."""

    profile: Path | None = Path("default")
    name: ClassVar[str] = "contourkv_offline"

    def __post_init__(self) -> None:
        if self.profile is None:
            raise InputError("profile", "contourkv_offline reads a fitted profile", "pass profile=default or a file "
                             "(or use contourkv for the online estimate)")
        super().__post_init__()


@dataclass(frozen=True)
class ContourKVPred(ContourKV):
    """ContourKV on the predictor-weighted profile ``D_c(b) * q_c(b)`` (module docstring).

    ``q_c(b)``: the calibrated probability of a significant gap (``kappa_hat > threshold``)
    from a dropped-mass predictor (``evictlab.stats.predictors``), with the features of cell
    ``c`` at budget ``b``: ``dropped_mass = D_c(b)``, ``entropy_norm`` = the cell's mean
    ``H/log n`` (fitted, or of the window's rows online), ``log2_s = log2(max(b, 1))``,
    ``depth = layer / (n_layers - 1)``. ``predictor``: a file from ``evictlab predictor fit``;
    None uses the predictor embedded in ``profile`` (``contour fit --predictor``).
    """

    predictor: Path | None = None
    name: ClassVar[str] = "contourkv_pred"
    _predictor: Any = field(default=None, init=False, repr=False, compare=False)

    def load(self) -> ContourKVPred:
        """Read the profile and the predictor (see :meth:`ContourKV.load`)."""
        super().load()
        if self._predictor is not None:
            return self
        from evictlab.stats.predictors import Predictor

        pred: Predictor | None = None
        if self.predictor is not None:
            try:
                pred = Predictor.load(self.predictor)
            except InputError as exc:
                raise InputError("predictor", f"{exc.field}: {exc.problem}", exc.fix) from None
        elif self._profile is not None and self._profile.predictor is not None:
            pred = Predictor.from_dict(self._profile.predictor, source=f"{self.profile} (embedded predictor)")
        if pred is None and self.is_default:
            return self  # the shipped profile's embedded predictor, read once the model is known (_bind)
        if pred is None:
            raise InputError("allocator_param", "contourkv_pred needs a fitted dropped-mass predictor",
                             "pass predictor=PRED.json (from `evictlab predictor fit RESULTS --out PRED.json`) or "
                             "profile=PROFILE.json fitted with `evictlab contour fit ... --predictor PRED.json`")
        object.__setattr__(self, "_predictor", pred)
        return self

    def _bind(self, profile: ContourProfile) -> ContourProfile:
        if self._predictor is None:
            from evictlab.stats.predictors import Predictor

            if profile.predictor is None:
                raise InputError("profile", "default: the shipped profile embeds no dropped-mass predictor, which "
                                 "contourkv_pred needs", "pass predictor=PRED.json (from `evictlab predictor fit`)")
            object.__setattr__(self, "_predictor", Predictor.from_dict(profile.predictor, source="shipped profile"))
        return profile

    def weights(self, inputs: AllocInputs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        n_layers, hk = inputs.lengths.shape
        prof = self.fitted(inputs.geometry) if self.profile is not None else None
        if prof is not None:
            ent = prof.entropy_norm.reshape(-1)
        else:
            assert inputs.window is not None  # knots() refused it otherwise
            ent = np.asarray(inputs.window.entropy_norm, dtype=np.float64).mean(axis=0).reshape(-1)
        depth = np.repeat(np.arange(n_layers) / max(n_layers - 1, 1), hk)
        columns = {
            "dropped_mass": y,
            "entropy_norm": np.broadcast_to(ent[:, None], y.shape),
            "log2_s": np.log2(np.maximum(x, 1.0)),
            "depth": np.broadcast_to(depth[:, None], y.shape),
        }
        X = np.stack([np.asarray(columns[f], dtype=np.float64).reshape(-1) for f in self._predictor.features], axis=1)
        return y * self._predictor.predict_proba(X).reshape(y.shape)
