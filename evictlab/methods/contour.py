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

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from evictlab.contour.level import envelope, top_increments
from evictlab.errors import InputError
from evictlab.methods.base import AllocInputs, Allocator

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.contour.profile import ContourProfile
    from evictlab.models.geometry import ModelGeometry
    from evictlab.stats.predictors import Predictor

__all__ = ["ContourKV", "ContourKVPred"]


def _load_profile(path: Path) -> ContourProfile:
    from evictlab.contour.profile import ContourProfile

    try:
        return ContourProfile.load(path)
    except InputError as exc:  # name the parameter; the problem names the file
        raise InputError("profile", f"{exc.field}: {exc.problem}", exc.fix) from None


@dataclass(frozen=True)
class ContourKV(Allocator):
    """ContourKV: cells reach one dropped-mass level; flat cells get more (module docstring).

    Inputs: :class:`AllocInputs` (lengths, floors, windows, budget; ``next_position`` and
    ``geometry`` when the decode loop calls; ``window`` in online mode). Returns int64
    ``(n_layers, kv_heads)`` summing exactly to ``inputs.target``, ``floors <= sizes <=
    min(lengths, window - 1)``. Reads no scores: any scorer picks the kept keys.

    ``profile``: a file from ``evictlab contour fit`` (offline; checked against the model's
    geometry before the run), or None to estimate the profiles online.
    """

    profile: Path | None = None
    name: ClassVar[str] = "contourkv"
    _profile: Any = field(default=None, init=False, repr=False, compare=False)

    def load(self) -> ContourKV:
        """Read the profile file (the registry's factory calls this once, after the
        dataclass is built: construction itself reads nothing)."""
        if self.profile is not None and self._profile is None:
            object.__setattr__(self, "_profile", _load_profile(Path(self.profile)))
        return self

    @property
    def needs(self) -> frozenset[str]:
        return frozenset() if self.profile is not None else frozenset({"window_profile"})

    def check(self, geometry: ModelGeometry) -> None:
        if self._profile is not None:
            self._checked(geometry, None)

    def _checked(self, geometry: ModelGeometry | None, shape: tuple[int, int] | None) -> None:
        try:
            self._profile.check(geometry, shape, source="profile")
        except InputError as exc:
            raise InputError("allocator_param", f"profile {self.profile} {exc.problem}", exc.fix) from None

    # -- the profiles as knots ---------------------------------------------------------
    def knots(self, inputs: AllocInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every cell's profile as knots ``(x, y, n_knots)``: ``x`` in entries (``b``), ``y`` the
        dropped mass (before weighting and the envelope), cells layer-major, float64 ``(cells, K)``."""
        n_layers, hk = inputs.lengths.shape
        if self._profile is not None:
            self._checked(inputs.geometry, (n_layers, hk))
            x, y = self._profile.knots(self.reference_lengths(inputs))
            return x, y, np.full(x.shape[0], x.shape[1], dtype=np.int64)
        if inputs.window is None:
            raise InputError("window", "contourkv without a profile estimates its profiles from the observation "
                             "window, which these inputs lack (AllocInputs.window is None)",
                             "run it in the decode loop, pass AllocInputs(window=...), or give profile=PROFILE.json")
        lens = inputs.lengths
        K = int(lens.max()) + 1
        x = np.broadcast_to(np.arange(K, dtype=np.float64), (n_layers * hk, K)).copy()
        y = np.zeros((n_layers * hk, K))
        for l, t in enumerate(inputs.window.tail):
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
        """The profile the level runs on (ContourKV: the dropped mass itself)."""
        return y

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        floors, lengths = inputs.floors, inputs.lengths
        caps = lengths.copy()
        for l, w in enumerate(inputs.windows):
            if w is not None:
                caps[l] = np.minimum(caps[l], w - 1)  # a sliding cell never keeps more than w - 1
        if (floors > caps).any() or int(caps.sum()) < inputs.target:
            raise InputError("lengths", f"sliding cells hold entries no later query can attend (caps "
                             f"{int(caps.sum())} < target {inputs.target}, or a floor above window - 1)",
                             "drop entries with pos <= next - window first (the decode loop does)")
        x, y, nk = self.knots(inputs)
        prio = envelope(self.weights(inputs, x, y))
        if not np.isfinite(prio).all():
            raise InputError("window" if self._profile is None else "profile", "the profile holds NaN or inf",
                             "check the observation window's attention (or refit the profile)")
        extra = inputs.target - int(floors.sum())
        # the knots rise strictly by construction (the fitted grid, or b = 0..length)
        counts = top_increments(x, prio, nk, (caps - floors).reshape(-1), extra, validate=False)
        return floors + counts.reshape(floors.shape)


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
        if pred is None:
            raise InputError("allocator_param", "contourkv_pred needs a fitted dropped-mass predictor",
                             "pass predictor=PRED.json (from `evictlab predictor fit RESULTS --out PRED.json`) or "
                             "profile=PROFILE.json fitted with `evictlab contour fit ... --predictor PRED.json`")
        object.__setattr__(self, "_predictor", pred)
        return self

    def weights(self, inputs: AllocInputs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        n_layers, hk = inputs.lengths.shape
        if self._profile is not None:
            ent = self._profile.entropy_norm.reshape(-1)
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
