"""Seeded percentile bootstrap for medians, means and ROC AUC: over rows, or over clusters.

One resampling engine (:func:`resample_counts`) serves every interval. It draws, for each
bootstrap replicate, how many times each observation enters the resample (a count vector),
following a :class:`Design`:

- ``Design.rows(n)``: the ordinary bootstrap, n draws with replacement from the n
  observations;
- ``Design.nested([prompt])``: a two-stage cluster bootstrap: draw as many prompts as there
  are, with replacement, then within every drawn prompt draw as many of its rows as it has,
  with replacement (a prompt drawn twice gets two independent row resamples);
- ``Design.nested([model, prompt, row])``: the same recursion over more levels (models, then
  prompts within the drawn models, then rows within the drawn prompts, then observations
  of the drawn rows), for claims pooled across models;
- ``Design.whole_clusters(example)``: draw as many clusters as there are, with replacement,
  each bringing all its observations (an example with every comparison it is in);
- ``strata=k``: the k outermost levels are strata, kept whole in every replicate (each
  stratum resamples its own clusters), e.g. one (model, task, context) group's examples.

A statistic is then computed from the count vector without materialising the resample
(weighted order statistics for the median, a weighted mean, the Mann-Whitney statistic
with multiplicities for AUC), so all statistics of one group share one set of replicates.
The interval is the percentile interval of the replicates (:func:`percentile_interval`, the
one place a level becomes quantiles); :func:`evictlab.report.markdown.ci` prints it.

Every resample comes from ``numpy.random.default_rng`` seeded from the caller's seed and a
stable key (CRC-32 of the group's name), so a confidence interval is a pure function of
(data, design, seed, key, number of resamples): the same on every run and machine, and
independent of the order in which groups are processed. Estimators and their caveats:
docs/statistics.md ("Confidence intervals").
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.errors import InputError

_CHUNK_ELEMS = 4_000_000  # resample at most this many counts at once (memory bound)

ROW_METHOD = "row bootstrap"


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a percentile-bootstrap confidence interval.

    ``lo``/``hi`` are NaN when the sample is empty (or, for AUC, one class is absent).
    ``n`` is the number of observations the estimate used; ``method`` names the resampling
    design (:meth:`Design.describe`).
    """

    value: float
    lo: float
    hi: float
    n: int
    method: str = ROW_METHOD

    def fmt(self, digits: int = 3, **kw: Any) -> str:
        """``0.031 [0.027, 0.036]`` (or ``n/a`` when there is no data): :func:`evictlab.report.markdown.ci`."""
        from evictlab.report.markdown import ci

        return ci(self.value, self.lo, self.hi, digits, **kw)


# --------------------------------------------------------------------------- designs


@dataclass(frozen=True)
class Design:
    """Which units are resampled: nested cluster levels (outermost first) above the observations.

    ``codes[k]`` (int64 ``[n]``) labels observation i's cluster at level k; a level-k
    cluster must lie inside one level-(k-1) cluster (labels are made nested on construction,
    so equal labels under different parents are different clusters). ``names[k]`` is the
    level's name for :meth:`describe`. No level: the ordinary row bootstrap. With
    ``whole_leaves`` the last stage takes every observation of a drawn innermost cluster;
    the first ``strata`` levels are strata, taken whole (never resampled).
    """

    n: int
    codes: tuple[np.ndarray, ...] = ()
    names: tuple[str, ...] = ()
    #: True: the observations of a drawn innermost cluster are all included, not resampled
    #: (a drawn attention row brings its observations at every budget s).
    whole_leaves: bool = False
    #: The number of outermost levels that are strata: every replicate holds each of their
    #: clusters once, and the levels below are resampled within each.
    strata: int = 0

    def __post_init__(self) -> None:
        if self.strata < 0 or self.strata > len(self.codes) or (self.strata == len(self.codes) and self.whole_leaves
                                                                and self.strata):
            raise InputError("strata", f"{self.strata} strata of {len(self.codes)} levels leave nothing to resample",
                             "keep at least one resampled level below the strata")

    def whole(self) -> np.ndarray:
        """Per depth of the design's tree (the root's children first), whether every node
        takes each child once instead of drawing (the strata, and ``whole_leaves`` last)."""
        w = np.zeros(len(self.codes) + 1, dtype=np.bool_)
        w[:self.strata] = True
        w[-1] = self.whole_leaves
        return w

    @classmethod
    def rows(cls, n: int) -> "Design":
        """The ordinary bootstrap over ``n`` independent observations."""
        return cls(int(n))

    @classmethod
    def nested(cls, labels: Sequence[np.ndarray | Sequence[object]], names: Sequence[str] | None = None,
               whole_leaves: bool = False, strata: int = 0) -> "Design":
        """Clusters given by one label array per level, outermost first (any hashable labels).

        Labels are combined with the levels above them, so prompt 0 of model A and prompt 0
        of model B are different clusters.
        """
        arrays = [np.asarray(a) for a in labels]
        if not arrays:
            raise InputError("clusters", "no cluster level given", "pass at least one label array, or use Design.rows(n)")
        n = arrays[0].shape[0]
        if any(a.ndim != 1 or a.shape[0] != n for a in arrays):
            raise InputError("clusters", "every level needs one label per observation", f"pass 1-D arrays of length {n}")
        names = tuple(names) if names is not None else tuple(f"level {k}" for k in range(len(arrays)))
        if len(names) != len(arrays):
            raise InputError("clusters", f"{len(names)} names for {len(arrays)} levels", "name every level")
        codes: list[np.ndarray] = []
        prev = np.zeros(n, dtype=np.int64)
        for a in arrays:
            _, inv = np.unique(a, return_inverse=True)
            pair = prev * (int(inv.max()) + 1 if n else 1) + inv.reshape(-1)
            _, code = np.unique(pair, return_inverse=True)
            prev = code.reshape(-1).astype(np.int64)
            codes.append(prev)
        return cls(n, tuple(codes), names, whole_leaves, strata)

    @classmethod
    def whole_clusters(cls, labels: np.ndarray | Sequence[object], name: str = "example",
                       strata: np.ndarray | Sequence[object] | None = None, strata_name: str = "stratum") -> "Design":
        """Clusters drawn with replacement, each with all its observations (no resampling
        inside a cluster); with ``strata`` labels, every stratum is kept and its own
        clusters are drawn (as many as it has)."""
        if strata is None:
            return cls.nested([labels], [name], whole_leaves=True)
        return cls.nested([strata, labels], [strata_name, name], whole_leaves=True, strata=1)

    @classmethod
    def from_codes(cls, codes: Sequence[np.ndarray], names: Sequence[str], whole_leaves: bool = False) -> "Design":
        """A design from integer codes that are already nested-unique (a level-k code never
        appears under two level-(k-1) codes), e.g. a subset of :meth:`nested`'s codes."""
        codes = tuple(np.asarray(c, dtype=np.int64) for c in codes)
        return cls(int(codes[0].shape[0]) if codes else 0, codes, tuple(names), whole_leaves and bool(codes))

    def clusters(self, level: int = 0) -> int:
        """Number of clusters at ``level`` (``n`` when there is no such level)."""
        if level >= len(self.codes):
            return self.n
        return int(np.unique(self.codes[level]).size)

    def describe(self) -> str:
        """e.g. ``cluster bootstrap: prompt > row (8 prompts, 2160 rows)``, or ``row bootstrap``.

        A design whose outermost level has a single cluster says so: its interval cannot
        reflect variation between such clusters.
        """
        if not self.codes or self.n == 0:
            return ROW_METHOD
        counts = ", ".join(f"{self.clusters(k)} {name}{'' if self.clusters(k) == 1 else 's'}"
                           for k, name in enumerate(self.names))
        if self.strata:
            inner = ", ".join(f"{self.clusters(k)} {self.names[k]}{'' if self.clusters(k) == 1 else 's'}"
                              for k in range(self.strata, len(self.names)))
            return (f"cluster bootstrap within strata ({' > '.join(self.names[:self.strata])}: "
                    f"{self.clusters(self.strata - 1)}): {' > '.join(self.names[self.strata:])} ({inner})"
                    + ("; whole clusters" if self.whole_leaves else ""))
        text = f"cluster bootstrap: {' > '.join(self.names)} ({counts})"
        if self.clusters(0) == 1 and len(self.names) > 1:
            text += f"; one {self.names[0]} only, so no between-{self.names[0]} variation"
        return text

    def subset(self, mask: np.ndarray) -> "Design":
        """The design restricted to the observations where ``mask`` is true."""
        mask = np.asarray(mask, dtype=bool)
        if not self.codes:
            return Design(int(mask.sum()))
        return Design.nested([c[mask] for c in self.codes], self.names, self.whole_leaves, self.strata)


@dataclass(frozen=True)
class _Tree:
    """A design as a tree: depth d has ``n_child[d][j]`` children starting at ``first[d][j]``.

    Depth 0 is the root; the last depth's children are the observations, in ``order``
    (observations sorted so every cluster is a contiguous run).
    """

    order: np.ndarray
    first: tuple[np.ndarray, ...]
    n_child: tuple[np.ndarray, ...]


def _tree(design: Design) -> _Tree:
    n = design.n
    if not design.codes:
        return _Tree(np.arange(n), (np.zeros(1, np.int64),), (np.array([n], np.int64),))
    order = np.lexsort(tuple(reversed(design.codes)))
    levels = [c[order] for c in design.codes]  # sorted: every cluster is a contiguous run
    first, n_child = [], []
    parent = np.zeros(n, dtype=np.int64)  # root
    n_parent = 1
    for lev in [*levels, np.arange(n, dtype=np.int64)]:
        # children of each parent node = distinct labels of this level under it, contiguous
        start = np.flatnonzero(np.r_[True, lev[1:] != lev[:-1]]) if n else np.zeros(0, np.int64)
        child_parent = parent[start]
        cnt = np.bincount(child_parent, minlength=n_parent).astype(np.int64)
        first.append(np.r_[0, np.cumsum(cnt)[:-1]].astype(np.int64))
        n_child.append(cnt)
        # this level's node ids become the next level's parents
        node = np.cumsum(np.r_[True, lev[1:] != lev[:-1]]) - 1 if n else np.zeros(0, np.int64)
        parent, n_parent = node.astype(np.int64), int(start.size)
    return _Tree(order, tuple(first), tuple(n_child))


def resample_counts(design: Design, rng: np.random.Generator, n_boot: int) -> Iterator[np.ndarray]:
    """Replicates of ``design`` as count chunks: int32 ``(b, n)``, row r = multiplicities of the observations.

    Chunks hold at most about ``_CHUNK_ELEMS`` counts; their ``b`` sum to ``n_boot``.
    At every depth each drawn node draws ``n_child`` of its children uniformly with
    replacement (the recursion of the module docstring). The draws come from the Numba
    kernel :func:`evictlab.stats.kernels.resample_counts_kernel`, seeded per chunk from
    ``rng``; :func:`resample_counts_reference` is the same recursion in numpy (tests
    check both against the hand-computed distribution).
    """
    from evictlab.stats.kernels import resample_counts_kernel

    n = design.n
    tree = _tree(design)
    first = np.concatenate(tree.first).astype(np.int64)
    n_child = np.concatenate(tree.n_child).astype(np.int64)
    depth_off = np.r_[0, np.cumsum([a.size for a in tree.first])].astype(np.int64)
    order = tree.order.astype(np.int64)
    per = max(1, _CHUNK_ELEMS // max(n, 1))
    done = 0
    while done < n_boot:
        b = min(per, n_boot - done)
        out = np.zeros((b, n), dtype=np.int32)
        resample_counts_kernel(first, n_child, depth_off, order, design.whole(), np.int64(rng.integers(0, 2**62)),
                               out)
        yield out
        done += b


def resample_counts_reference(design: Design, rng: np.random.Generator, n_boot: int) -> Iterator[np.ndarray]:
    """Plain-numpy :func:`resample_counts` (vectorised over replicates, depth by depth).

    With no cluster level this is exactly ``rng.integers(0, n, size=(b, n))`` turned into
    counts.
    """
    n = design.n
    tree = _tree(design)
    whole = design.whole()
    per = max(1, _CHUNK_ELEMS // max(n, 1))
    done = 0
    while done < n_boot:
        b = min(per, n_boot - done)
        rep = np.arange(b, dtype=np.int64)
        node = np.zeros(b, dtype=np.int64)
        for d, (first, n_child) in enumerate(zip(tree.first, tree.n_child)):
            k = n_child[node]
            if np.all(n_child == 1):
                node = first[node]
                continue
            width = np.repeat(k, k)
            rep = np.repeat(rep, k)
            if whole[d]:  # every child of a drawn node (a stratum's clusters, a cluster's observations)
                offset = np.arange(width.size) - np.repeat(np.cumsum(k) - k, k)
                node = np.repeat(first[node], k) + offset
            else:
                node = np.repeat(first[node], k) + rng.integers(0, width)
        counts = np.bincount(rep * n + tree.order[node], minlength=b * n).reshape(b, n)
        yield counts.astype(np.int32)
        done += b


# --------------------------------------------------------------------------- statistics


class Stat:
    """A statistic computable from a count matrix: ``point()`` and ``replicates(counts) -> (b,)``.

    ``mask`` (bool ``[n]``) restricts the statistic to some observations of the design
    (e.g. finite values); replicates whose masked resample is empty are NaN and dropped.
    """

    mask: np.ndarray
    n: int

    def point(self) -> float:
        raise NotImplementedError

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Median(Stat):
    """Median of ``x[mask]``; a replicate's median is the median of its expanded resample."""

    def __init__(self, x: np.ndarray, mask: np.ndarray | None = None) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.mask = np.ones(x.size, bool) if mask is None else np.asarray(mask, bool)
        v = x[self.mask]
        if not np.all(np.isfinite(v)):
            raise InputError("x", "contains NaN or inf", "filter non-finite values and count them")
        self.n = v.size
        by_value = np.argsort(v, kind="stable")
        self._sorted = np.ascontiguousarray(v[by_value])
        self._cols = np.flatnonzero(self.mask)[by_value].astype(np.int64)  # count columns in value order

    def point(self) -> float:
        return float(np.median(self._sorted)) if self.n else float("nan")

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        from evictlab.stats.kernels import median_from_counts

        out = np.empty(counts.shape[0])
        median_from_counts(counts, self._cols, self._sorted, out)
        return out

    def replicates_reference(self, counts: np.ndarray) -> np.ndarray:
        """Plain numpy (cumulative counts, then a search per replicate); equals :meth:`replicates`."""
        cum = counts[:, self._cols].astype(np.int64)
        np.cumsum(cum, axis=1, out=cum)
        out = np.full(cum.shape[0], np.nan)
        for r in range(cum.shape[0]):
            tot = int(cum[r, -1]) if cum.shape[1] else 0
            if tot == 0:
                continue
            # 0-based order statistics floor((N-1)/2) and floor(N/2): the element at sorted
            # position j is the k-th iff cum[j-1] <= k < cum[j]
            lo, hi = np.searchsorted(cum[r], [(tot - 1) // 2, tot // 2], side="right")
            out[r] = 0.5 * (self._sorted[lo] + self._sorted[hi])
        return out


class Mean(Stat):
    """Mean of ``x[mask]`` (of a 0/1 indicator: a fraction)."""

    def __init__(self, x: np.ndarray, mask: np.ndarray | None = None) -> None:
        x = np.asarray(x, dtype=np.float64)
        self.mask = np.ones(x.size, bool) if mask is None else np.asarray(mask, bool)
        self._x = x[self.mask]
        self.n = self._x.size

    def point(self) -> float:
        return float(np.mean(self._x)) if self.n else float("nan")

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        c = counts[:, self.mask]
        tot = c.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (c @ self._x) / tot


class AUC(Stat):
    """ROC AUC of ``score`` for labels ``y`` (Mann-Whitney, ties one half), from multiplicities.

    The observations are sorted by score once and cut into tie levels; a replicate's AUC is
    sum_l pos_l (neg_below_l + neg_l / 2) / (P N) over tie levels l, with pos_l / neg_l the
    resampled counts of positives / negatives at level l. Replicates with one class absent
    are NaN (dropped).
    """

    def __init__(self, y: np.ndarray, score: np.ndarray, mask: np.ndarray | None = None) -> None:
        y = np.asarray(y, dtype=bool)
        score = np.asarray(score, dtype=np.float64)
        self.mask = np.ones(y.size, bool) if mask is None else np.asarray(mask, bool)
        self._y, self._score = y[self.mask], score[self.mask]
        self.n = self._y.size
        by_score = np.argsort(self._score, kind="stable")
        s = self._score[by_score]
        self._cols = np.flatnonzero(self.mask)[by_score].astype(np.int64)  # count columns in score order
        self._pos = self._y[by_score].astype(np.int32)
        new_level = np.r_[True, s[1:] != s[:-1]] if s.size else np.zeros(0, bool)
        self._starts = np.flatnonzero(new_level)
        self._level = np.cumsum(new_level).astype(np.int64)

    def point(self) -> float:
        return roc_auc(self._y, self._score)

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        from evictlab.stats.kernels import auc_from_counts

        out = np.empty(counts.shape[0])
        auc_from_counts(counts, self._cols, self._pos.astype(bool), self._level, out)
        return out

    def replicates_reference(self, counts: np.ndarray) -> np.ndarray:
        """Plain numpy (per-level counts by ``reduceat``); equals :meth:`replicates`."""
        if self.n == 0:
            return np.full(counts.shape[0], np.nan)
        c = counts[:, self._cols].astype(np.int64)
        pos_l = np.add.reduceat(c * self._pos, self._starts, axis=1).astype(np.float64)
        neg_l = np.add.reduceat(c, self._starts, axis=1) - pos_l
        below = np.cumsum(neg_l, axis=1) - neg_l
        P, N = pos_l.sum(axis=1), neg_l.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (pos_l * (below + 0.5 * neg_l)).sum(axis=1) / (P * N)


class RatioOfMedians(Stat):
    """median(num[mask]) / median(den[mask]) (e.g. the ratio-of-medians form of pi(s))."""

    def __init__(self, num: np.ndarray, den: np.ndarray, mask: np.ndarray | None = None) -> None:
        self._num, self._den = Median(num, mask), Median(den, mask)
        self.mask, self.n = self._num.mask, self._num.n

    def point(self) -> float:
        d = self._den.point()
        return self._num.point() / d if d != 0 else float("nan")

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._num.replicates(counts) / self._den.replicates(counts)


class SignShare(Stat):
    """Share of groups whose summed ``outcome`` has sign ``sign`` (+1, 0 or -1): e.g. per
    comparison the example outcomes (+1 win, 0 tie, -1 loss) summed, and the share of
    comparisons won (more example wins than losses). A replicate sums each observation's
    outcome times its multiplicity, so a comparison is decided again on every resample of
    its examples. Meant for designs where every group is in every replicate (groups inside
    strata, their examples resampled whole)."""

    def __init__(self, outcome: np.ndarray, groups: np.ndarray | Sequence[object], sign: int) -> None:
        x = np.asarray(outcome, dtype=np.float64)
        _, g = np.unique(np.asarray(groups), return_inverse=True)
        g = g.reshape(-1)
        self.mask = np.ones(x.size, bool)
        self.n = x.size
        self._sign = int(np.sign(sign))
        self._groups = int(g.max()) + 1 if x.size else 0
        self._by_group = np.zeros((x.size, self._groups))  # outcome in its group's column
        self._by_group[np.arange(x.size), g] = x
        self._sums = np.bincount(g, weights=x, minlength=self._groups)

    def point(self) -> float:
        return float(np.mean(np.sign(self._sums) == self._sign)) if self._groups else float("nan")

    def replicates(self, counts: np.ndarray) -> np.ndarray:
        s = counts.astype(np.float64) @ self._by_group  # (b, groups): each group's resampled sum
        return (np.sign(s) == self._sign).mean(axis=1)


def sign_rates(outcome: np.ndarray, groups: np.ndarray | Sequence[object], design: Design, *, seed: int,
               key: str = "", n_boot: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, how often its verdict holds under resampling: ``(labels, p_pos, p_neg)``,
    ``labels`` the sorted distinct ``groups`` and ``p_pos[k]`` / ``p_neg[k]`` the share of
    ``design``'s replicates in which group k's resampled summed ``outcome`` is > 0 / < 0
    (the replicates :func:`bootstrap` would draw with the same seed and key).

    A group with ``p_pos >= 0.975`` has a 95% percentile interval of its summed outcome
    above 0 (a *clear* win, e.g. of a comparison whose examples are resampled); ``p_neg >=
    0.975`` a clear loss; anything else is undecided at that level. This is the verdict a
    :class:`SignShare` counts, with its stability beside it: a share of groups won sits
    near the top of its own percentile interval when many groups are won by one or two
    examples, because most resamples undo such narrow wins."""
    _check(n_boot, 0.95)
    stat = SignShare(outcome, groups, 1)
    labels = np.unique(np.asarray(groups))
    if stat.mask.shape[0] != design.n:
        raise InputError("outcome", f"has {stat.mask.shape[0]} observations, the design {design.n}",
                         "build the outcomes and the design from the same table")
    pos = np.zeros(stat._groups)
    neg = np.zeros(stat._groups)
    for counts in resample_counts(design, rng_for(seed, key), n_boot):
        sums = counts.astype(np.float64) @ stat._by_group
        pos += (sums > 0).sum(axis=0)
        neg += (sums < 0).sum(axis=0)
    return labels, pos / n_boot, neg / n_boot


def rng_for(seed: int, key: str = "") -> np.random.Generator:
    """A generator seeded by ``seed`` and a stable hash of ``key`` (not Python's ``hash``)."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval at ``level`` of bootstrap ``replicates``: their
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's default, linear
    interpolation); NaNs when there are none. Every interval evictlab reports comes from here."""
    vals = np.asarray(replicates, dtype=np.float64)
    if vals.size == 0:
        return float("nan"), float("nan")
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(vals, [a, 1.0 - a])
    return float(lo), float(hi)


def _check(n_boot: int, level: float) -> None:
    if n_boot < 1:
        raise InputError("n_boot", f"must be >= 1, got {n_boot}", "use e.g. 1000 resamples")
    if not 0.0 < level < 1.0:
        raise InputError("level", f"must be in (0, 1), got {level}", "use e.g. 0.95")


def bootstrap(stats: Mapping[str, Stat], design: Design, *, seed: int, key: str = "", n_boot: int = 1000,
              level: float = 0.95) -> dict[str, Estimate]:
    """Percentile intervals of several statistics from one set of ``design`` replicates.

    Every statistic sees the same resamples (seeded by ``seed`` and ``key``). A statistic
    with no observations gets NaN throughout; with one observation, a zero-width interval.
    """
    _check(n_boot, level)
    for name, st in stats.items():
        if st.mask.shape[0] != design.n:
            raise InputError(name, f"has {st.mask.shape[0]} observations, the design {design.n}",
                             "build the statistic and the design from the same table")
    method = design.describe()
    reps: dict[str, list[np.ndarray]] = {name: [] for name in stats}
    live = {name: st for name, st in stats.items() if st.n > 1}
    if live:
        for counts in resample_counts(design, rng_for(seed, key), n_boot):
            for name, st in live.items():
                reps[name].append(st.replicates(counts))
    out: dict[str, Estimate] = {}
    for name, st in stats.items():
        point = st.point()
        if st.n == 0 or not np.isfinite(point):
            out[name] = Estimate(point if st.n else float("nan"), float("nan"), float("nan"), st.n, method)
            continue
        if st.n == 1:
            out[name] = Estimate(point, point, point, 1, method)
            continue
        vals = np.concatenate(reps[name])
        vals = vals[np.isfinite(vals)]
        if vals.size == 0:
            out[name] = Estimate(point, float("nan"), float("nan"), st.n, method)
            continue
        lo, hi = percentile_interval(vals, level)
        out[name] = Estimate(point, lo, hi, st.n, method)
    return out


def _one(stat: Stat, clusters: object, *, seed: int, key: str, n_boot: int, level: float) -> Estimate:
    n = stat.mask.shape[0]
    if clusters is None:
        design = Design.rows(n)
    elif isinstance(clusters, Design):
        design = clusters
    else:
        arr = clusters if isinstance(clusters, (list, tuple)) else [clusters]
        design = Design.nested(list(arr))  # type: ignore[arg-type]
    return bootstrap({"x": stat}, design, seed=seed, key=key, n_boot=n_boot, level=level)["x"]


def bootstrap_median(
    x: np.ndarray, *, seed: int, key: str = "", n_boot: int = 1000, level: float = 0.95, clusters: object = None
) -> Estimate:
    """Median of ``x`` with a percentile-bootstrap CI (non-finite values must be removed first).

    ``clusters``: None (row bootstrap), one label array (two-stage: clusters, then rows),
    a list of label arrays (outermost first), or a :class:`Design`.
    """
    _check(n_boot, level)
    return _one(Median(x), clusters, seed=seed, key=key, n_boot=n_boot, level=level)


def bootstrap_mean(
    x: np.ndarray, *, seed: int, key: str = "", n_boot: int = 1000, level: float = 0.95, clusters: object = None
) -> Estimate:
    """Mean of ``x`` (e.g. a 0/1 indicator: a fraction) with a percentile-bootstrap CI; ``clusters`` as above."""
    _check(n_boot, level)
    return _one(Mean(x), clusters, seed=seed, key=key, n_boot=n_boot, level=level)


def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank statistic (ties count one half); NaN if one class is absent.

    Equals ``sklearn.metrics.roc_auc_score`` (tested) but needs no Python loop per resample.
    """
    y = np.asarray(y, dtype=bool)
    score = np.asarray(score, dtype=np.float64)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = average_ranks(score)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_ranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks with ties replaced by their average rank (like scipy's rankdata)."""
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return np.zeros(0)
    order = np.argsort(a, kind="mergesort")
    sa = a[order]
    # boundaries of runs of equal values
    new = np.empty(sa.size, dtype=bool)
    new[0] = True
    np.not_equal(sa[1:], sa[:-1], out=new[1:])
    run_id = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], sa.size)
    avg = (starts + ends + 1) / 2.0  # mean of 1-based positions start+1..end
    ranks = np.empty(a.size)
    ranks[order] = avg[run_id]
    return ranks


def bootstrap_auc(
    y: np.ndarray,
    score: np.ndarray,
    *,
    seed: int,
    key: str = "",
    n_boot: int = 1000,
    level: float = 0.95,
    clusters: object = None,
) -> Estimate:
    """ROC AUC of ``score`` for labels ``y`` with a percentile-bootstrap CI; ``clusters`` as in :func:`bootstrap_median`.

    Resamples in which one class is absent are skipped.
    """
    _check(n_boot, level)
    return _one(AUC(y, score), clusters, seed=seed, key=key, n_boot=n_boot, level=level)


# --------------------------------------------------------------------------- clustering


def icc_oneway(x: np.ndarray, groups: np.ndarray) -> float:
    """Intra-class correlation ICC(1) of ``x`` within ``groups``: one-way random-effects ANOVA.

    With g groups of sizes n_i (N in total), group means xbar_i and grand mean xbar:
    MSB = sum_i n_i (xbar_i - xbar)^2 / (g - 1), MSW = sum (x - xbar_i)^2 / (N - g),
    n0 = (N - sum_i n_i^2 / N) / (g - 1) (the average group size corrected for unequal
    sizes), and ICC = (MSB - MSW) / (MSB + (n0 - 1) MSW). It estimates the share of the
    variance of x that lies between groups; it can be slightly negative when the groups
    differ less than noise would make them. NaN with fewer than 2 groups, no within-group
    replication, or no variance.
    """
    x = np.asarray(x, dtype=np.float64)
    _, g_idx = np.unique(np.asarray(groups), return_inverse=True)
    g_idx = g_idx.reshape(-1)
    N = x.size
    g = int(g_idx.max()) + 1 if N else 0
    if g < 2 or N - g < 1:
        return float("nan")
    n_i = np.bincount(g_idx, minlength=g).astype(np.float64)
    means = np.bincount(g_idx, weights=x, minlength=g) / n_i
    grand = x.mean()
    msb = float(np.sum(n_i * (means - grand) ** 2) / (g - 1))
    msw = float(np.sum((x - means[g_idx]) ** 2) / (N - g))
    n0 = (N - float(np.sum(n_i ** 2)) / N) / (g - 1)
    den = msb + (n0 - 1.0) * msw
    if not den > 0:
        return float("nan")
    return (msb - msw) / den


def rank_icc(x: np.ndarray, groups: np.ndarray) -> float:
    """:func:`icc_oneway` of the mid-ranks of ``x`` (robust to heavy tails; suits medians)."""
    return icc_oneway(average_ranks(np.asarray(x, dtype=np.float64)), groups)
