"""The evaluation grid as data: what the user asked for (:class:`GridSpec`) and one unit of
work (:class:`CellSpec`).

A grid is models x tasks x context lengths x budgets x methods x modes x protocols, each
over the same ``n`` seeded examples (contexts) and, of each context, its first ``questions``
questions (all the task asks when None). Its **cells** are:

- one ``full`` cell per (model, task, context): the full cache (stock ``DynamicCache``,
  nothing evicted), the reference for KL and top-1 agreement and the accuracy every
  comparison is read against;
- one cell per (model, task, context, protocol, budget, method, mode) otherwise.

``tasks`` may name ``suite`` (:mod:`evictlab.tasks.suite`): the suite's task families, with
every (model, task, context) cell where the shipped full-cache table says the model cannot
do the task (a floor: exact match below 0.8) left out of the grid; ``floors`` holds those
cells with the measured accuracy, and the manifest and the report list them.

``tasks`` may name the attention-dilution tasks ``dilution_near_miss_kK`` and
``dilution_filler_kK`` (:mod:`evictlab.tasks.distractors`: needle retrieval with K labelled
distractors; the context length is the filler besides the needles), and, with
``GridSpec.build(distractors=...)``, their families ``dilution_near_miss`` /
``dilution_filler``, expanded to one task per count.

Two combinations are not cells, and the manifest lists them as skipped with the reason:
``uniform`` mode of a method whose allocator is already ``uniform`` (it *is* the physical
run), and the ``query-aware`` protocol on ``heldout_ppl`` (a perplexity window has no
question to be aware of).

Modes (docs/evaluation.md): ``physical`` = the allocator's ragged per-cell sizes in the
paged store that frees evicted entries; ``uniform`` = the same scorer with equal per-cell
sizes (``+uniform``: a fixed selection under a real budget); ``masked`` = the allocator's
ragged sizes held in the masked store (the full cache stays in memory: the audit of
others). Protocols: :data:`evictlab.decode.config.PROTOCOLS`.

Prefills (:data:`PREFILLS`, one per grid): ``one-pass`` (the default) feeds the whole
context in one pass and compresses once after it, so the prefill is the same for every arm:
the grid runs per **context unit** (:class:`ContextUnit`: one (model, task, context,
example) with every cell of that (model, task, context)), prefilling the context once
(:class:`evictlab.decode.shared.SharedContext`) and answering every question with the full
cache and every evicting arm from it. ``chunked`` is the per-arm path: every cell feeds the
context in chunks of ``loop.chunk_size`` tokens, compressing after each, and runs alone
(a cell is the unit); its rows name the chunk size, one-pass rows have none.

A :class:`CellSpec` carries everything its run needs (model name, task, sizes, seeds, the
loop settings, the method's parameters), is frozen, hashable and picklable, so a local loop
or a remote executor can call :func:`evictlab.eval.runner.run_cell` on it.

Errors are :class:`InputError` with neutral fields (``models``, ``tasks``, ``contexts``,
``budgets``, ``methods``, ``modes``, ``protocols``, ``n``, ``seed``, ``scorer_param``,
``allocator_param``, ``ppl_target``); ``evictlab eval run`` names its own options.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from evictlab.decode.config import DecodeConfig, LoopSettings
from evictlab.errors import InputError, refuse_duplicates
from evictlab.kv.budget import Budget
from evictlab.methods.method import Method

__all__ = [
    "FULL",
    "GRID_VERSION",
    "MODES",
    "PREFILLS",
    "PROTOCOLS",
    "CellSpec",
    "ContextUnit",
    "GridSpec",
    "budget_text",
]

GRID_VERSION = 2
"""Version of the grid's manifest and of the results' columns (bump on any change).
2: the prefill (one-pass units) and several questions per context (rows per question).
Methods with bracket parameters (``snapkv[window=32]``) did not bump it: a grid without them
has the same manifest, cell keys and columns as before, and the new texts only appear in
new grids (an older evictlab refuses them as unknown scorers, in one line)."""
FULL = "full"
"""The method (and mode) name of the full-cache reference rows."""
MODES: tuple[str, ...] = ("physical", "uniform", "masked")
PROTOCOLS: tuple[str, ...] = ("query-agnostic", "query-aware")
PREFILLS: tuple[str, ...] = ("one-pass", "chunked")
"""How a context is fed: once, compressed after it, shared by every arm (``one-pass``), or in
chunks of ``chunk_size`` tokens compressed as they come, per arm (``chunked``)."""
ONE_PASS = "one-pass"
NO_PROTOCOL = "none"
"""The protocol of the full-cache rows: nothing is compressed, so neither applies."""


def budget_text(budget: Budget) -> str:
    """Canonical text of a budget: ``64/cell``, ``4096total`` or ``2097152B``
    (:meth:`Budget.parse` reads it back to the same budget)."""
    return {"tokens_per_cell": f"{budget.value}/cell", "total_tokens": f"{budget.value}total",
            "bytes": f"{budget.value}B"}[budget.unit]


def _nonempty(items: Sequence[Any], name: str, fix: str) -> None:
    if not items:
        raise InputError(name, "the list is empty", fix)


@functools.lru_cache(maxsize=64)
def cell_method(spec: str, scorer_params: tuple[tuple[str, str], ...],
                allocator_params: tuple[tuple[str, str], ...]) -> Method:
    """The built method of a cell (:func:`evictlab.methods.build_method`), once per process
    for each (method, parameters): the grid's validation and every cell of the same
    method share one object (a fitted profile is read once)."""
    from evictlab.methods import build_method

    return build_method(spec, dict(scorer_params), dict(allocator_params))


@functools.lru_cache(maxsize=256)
def _canonical_method(spec: str) -> tuple[str, str, str]:
    """``(canonical spec, scorer, allocator)`` of a method text, the parts with their bracket
    parameters (:func:`evictlab.methods.registry.parse_method_text`): ``snapkv+uniform`` ->
    ``("snapkv", "snapkv", "uniform")``; ``trimkv[gates=x]+global`` -> ``(...,
    "trimkv[gates=x]", "global")``. A bracketed part is an arm of its own everywhere the
    grid names scorers and allocators (cells, rows, ``eval compare``)."""
    from evictlab.methods import parse_method_text

    text = parse_method_text(spec)
    return text.text, text.scorer_text, text.allocator_text


@dataclass(frozen=True)
class CellSpec:
    """One unit of work: one method (or the full cache) on ``n`` examples of one task.

    ``method`` is ``"full"`` or a canonical method text (``scorer[+allocator]``, each part
    with its bracket parameters: ``snapkv[window=32]+adakv``); ``mode`` is ``"full"``
    or one of :data:`MODES`; ``protocol`` is ``"none"`` (full) or one of :data:`PROTOCOLS`;
    ``budget`` a canonical budget text (None for full). ``scorer_params`` /
    ``allocator_params`` are this method's effective ``(key, value)`` pairs as typed
    (strings), sorted: the routed ``--scorer-param`` / ``--allocator-param`` with the bracket
    parameters over them. :attr:`scorer` / :attr:`allocator` are the parts' texts with their
    brackets (``snapkv[window=32]``).
    ``target_tokens`` is the length of a ``heldout_ppl`` target window. ``trace``: also
    record the per-compression diagnostics (:func:`evictlab.eval.runner.run_cell_traced`).
    ``prefill``: one of :data:`PREFILLS`; ``questions``: how many questions of each
    context are answered (the first ones; None: all the task asks).
    """

    model: str
    task: str
    context: int
    method: str
    mode: str
    protocol: str
    budget: str | None
    n: int
    seed: int
    loop: LoopSettings = field(default_factory=LoopSettings)
    scorer_params: tuple[tuple[str, str], ...] = ()
    allocator_params: tuple[tuple[str, str], ...] = ()
    target_tokens: int = 32
    device: str = "cpu"
    trace: bool = False
    prefill: str = ONE_PASS
    questions: int | None = None

    @property
    def is_full(self) -> bool:
        return self.method == FULL

    @property
    def scorer(self) -> str | None:
        return None if self.is_full else _canonical_method(self.method)[1]

    @property
    def allocator(self) -> str | None:
        return None if self.is_full else _canonical_method(self.method)[2]

    @property
    def key(self) -> str:
        """A stable, file-name-safe id: readable parts plus a hash of the whole spec."""
        parts = [Path(self.model).name or self.model, self.task, str(self.context), self.method, self.mode,
                 self.protocol, (self.budget or "-").replace("/", "per")]
        readable = re.sub(r"[^A-Za-z0-9.+=-]+", "_", "__".join(parts))
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
        return f"{readable[:150]}__{digest}"

    def full_cell(self) -> CellSpec:
        """The full-cache cell whose examples this cell is compared with."""
        return replace(self, method=FULL, mode=FULL, protocol=NO_PROTOCOL, budget=None, scorer_params=(),
                       allocator_params=(), trace=False)

    def decode_config(self) -> DecodeConfig:
        """The ``DecodeConfig`` of this cell (``mode="full"`` for the full cell), with the
        method built once per process (:func:`cell_method`). ``uniform`` mode runs the same
        scorer with the ``uniform`` allocator in the paged store."""
        if self.is_full:
            return DecodeConfig(mode="full", loop=self.loop)
        mode, spec, aparams = self.mode, self.method, self.allocator_params
        if mode == "uniform":
            mode, spec, aparams = "physical", str(self.scorer), ()
        return DecodeConfig(mode=mode, budget=Budget.parse(self.budget or ""),  # type: ignore[arg-type]
                            method=cell_method(spec, self.scorer_params, aparams), loop=self.loop,
                            query_aware=self.protocol == "query-aware")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scorer_params"] = [list(p) for p in self.scorer_params]
        d["allocator_params"] = [list(p) for p in self.allocator_params]
        if not self.trace:  # untraced cells keep the keys they had before the option existed
            del d["trace"]
        return d


@dataclass(frozen=True)
class ContextUnit:
    """One unit of work of a ``one-pass`` grid: example number ``example`` of one (model,
    task, context), with ``cells``, every cell of that (model, task, context) in the grid's
    order, the full cell first. Its context is prefilled once and every cell answers every
    question from it (:func:`evictlab.eval.runner.run_context`): one row per (cell,
    question). Frozen, hashable and picklable, like a cell."""

    cells: tuple[CellSpec, ...]
    example: int

    def __post_init__(self) -> None:
        if not self.cells or not self.cells[0].is_full:
            raise ValueError("a context unit starts with its full cell")
        first = self.cells[0]
        if any((c.model, c.task, c.context, c.prefill) != (first.model, first.task, first.context, ONE_PASS)
               for c in self.cells):
            raise ValueError("a context unit holds one-pass cells of one (model, task, context)")
        if not 0 <= self.example < first.n:
            raise ValueError(f"example {self.example} of {first.n}")

    @property
    def full(self) -> CellSpec:
        """The full cell (the reference of every arm of this context)."""
        return self.cells[0]

    @property
    def evicting(self) -> tuple[CellSpec, ...]:
        """The evicting cells (the arms)."""
        return self.cells[1:]

    @property
    def key(self) -> str:
        """A stable, file-name-safe id: readable parts plus a hash of every cell's key and
        the example (a cell's key names everything it is computed from)."""
        c = self.full
        readable = re.sub(r"[^A-Za-z0-9.+=-]+", "_",
                          "__".join([Path(c.model).name or c.model, c.task, str(c.context), f"ex{self.example}"]))
        digest = hashlib.sha256(json.dumps([[x.key for x in self.cells], self.example]).encode()).hexdigest()[:12]
        return f"{readable[:150]}__{digest}"


@dataclass(frozen=True)
class GridSpec:
    """The grid the user asked for; validated on construction, before any model loads.

    ``budgets`` and ``methods`` are stored canonically (``64`` -> ``64/cell``,
    ``snapkv+uniform`` -> ``snapkv``, bracket parameters sorted by key), so ``64`` and
    ``64/cell`` are the same budget (and a duplicate), as are ``snapkv[window=32,kernel=7]`` and
    ``snapkv[kernel=7, window=32]``. ``methods`` may name ``full`` (the full cache, always
    run); a grid of only ``full`` takes no budgets, modes or protocols. ``scorer_params`` /
    ``allocator_params`` are ``k=v`` (or ``name.k=v``) strings routed to the chosen methods
    as in ``decode`` (by registry name: ``snapkv.window=64`` reaches every ``snapkv[...]``
    arm); a method's bracket parameters override them for that method only.
    """

    models: tuple[str, ...]
    tasks: tuple[str, ...]
    contexts: tuple[int, ...]
    methods: tuple[str, ...]
    budgets: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    protocols: tuple[str, ...] = ()
    n: int = 10
    seed: int = 0
    loop: LoopSettings = field(default_factory=LoopSettings)
    scorer_params: tuple[tuple[str, str], ...] = ()
    allocator_params: tuple[tuple[str, str], ...] = ()
    target_tokens: int = 32
    device: str = "cpu"
    trace: bool = False
    prefill: str = ONE_PASS
    questions: int | None = None
    floors: tuple[tuple[str, str, int, str], ...] = ()

    @classmethod
    def build(cls, *, models: Sequence[str], tasks: Sequence[str], contexts: Sequence[int | str],
              methods: Sequence[str], budgets: Sequence[str] | None = None, modes: Sequence[str] | None = None,
              protocols: Sequence[str] | None = None, n: int = 10, seed: int = 0, loop: LoopSettings | None = None,
              scorer_params: Mapping[str, str] | None = None, allocator_params: Mapping[str, str] | None = None,
              target_tokens: int = 32, device: str = "cpu", trace: bool = False, prefill: str = ONE_PASS,
              questions: int | None = None, floor_table: Any = None,
              distractors: Sequence[int] | None = None) -> GridSpec:
        """A validated grid from lists as typed (``None`` modes / protocols: ``physical`` /
        ``query-agnostic`` when an evicting method is asked for). ``suite`` in ``tasks``
        expands to the suite's tasks less their floor cells, read from ``floor_table`` (a
        polars frame as ``benchmarks/task_floor.py`` writes; default: the shipped tables,
        :func:`evictlab.tasks.suite.shipped_floors`). ``distractors``: counts K that expand
        each dilution family in ``tasks`` (``dilution_near_miss``, ``dilution_filler``) in
        place to ``dilution_near_miss_kK`` for each K
        (:func:`evictlab.tasks.distractors.expand_families`; refused, field ``distractors``,
        when ``tasks`` names no family). The grid keeps the expanded tasks only."""
        from evictlab.tasks.distractors import expand_families
        from evictlab.tasks.suite import suite_grid

        ctx: list[int] = []
        for c in contexts:
            try:
                ctx.append(int(c))
            except (TypeError, ValueError):
                raise InputError("contexts", f"{c!r} is not a whole number of tokens",
                                 "write context lengths as integers, e.g. 1024,2048") from None
        evicting = any(m.strip() != FULL for m in methods)
        if modes is None:
            modes = ["physical"] if evicting else []
        if protocols is None:
            protocols = ["query-agnostic"] if evicting else []
        canon_budgets = [budget_text(Budget.parse(b)) for b in (budgets or [])]
        model_list = [m.strip() for m in models]
        task_list, floors = suite_grid(expand_families([t.strip() for t in tasks], distractors), model_list, ctx,
                                       floor_table)
        return cls(models=tuple(model_list), tasks=tuple(task_list), floors=tuple(floors),
                   contexts=tuple(ctx), methods=tuple(m.strip() for m in methods), budgets=tuple(canon_budgets),
                   modes=tuple(modes), protocols=tuple(protocols), n=int(n), seed=int(seed),
                   loop=loop or LoopSettings(), scorer_params=tuple(sorted((scorer_params or {}).items())),
                   allocator_params=tuple(sorted((allocator_params or {}).items())),
                   target_tokens=int(target_tokens), device=device, trace=bool(trace), prefill=prefill,
                   questions=None if questions is None else int(questions))

    def __post_init__(self) -> None:
        from evictlab.tasks.examples import EVAL_TASKS, is_eval_task

        _nonempty(self.models, "models", "name at least one model, e.g. smollm2-135m")
        refuse_duplicates(self.models, "models", "model")
        _nonempty(self.tasks, "tasks", f"use some of: {', '.join(EVAL_TASKS)}")
        for t in self.tasks:
            if not is_eval_task(t):
                raise InputError("tasks", f"unknown task {t!r}", f"use some of: {', '.join(EVAL_TASKS)}, "
                                 "dilution_near_miss_kK, dilution_filler_kK (or suite)")
        refuse_duplicates(self.tasks, "tasks", "task")
        for f in self.floors:
            if len(f) != 4 or f[0] not in self.models or f[1] not in self.tasks or f[2] not in self.contexts:
                raise InputError("floors", f"{list(f)} is not a (model, task, context, reason) cell of this grid",
                                 "build the grid with tasks = ['suite'] (GridSpec.build)")
        _nonempty(self.contexts, "contexts", "give at least one context length, e.g. 1024")
        for c in self.contexts:
            if c < 64:
                raise InputError("contexts", f"{c} tokens is too short for a task", "use at least 64 tokens")
        refuse_duplicates(self.contexts, "contexts", "context length")
        if self.n < 1:
            raise InputError("n", f"{self.n} examples", "use n >= 1")
        if self.seed < 0:
            raise InputError("seed", f"{self.seed} is negative", "use a seed >= 0, e.g. 0")
        if self.target_tokens < 1:
            raise InputError("ppl_target", f"{self.target_tokens} target tokens", "use at least 1")
        if self.prefill not in PREFILLS:
            raise InputError("prefill", f"unknown prefill {self.prefill!r}", f"use one of: {', '.join(PREFILLS)}")
        if self.prefill == ONE_PASS and self.loop.chunk_size != LoopSettings().chunk_size:
            # a one-pass prefill has no chunk: one value for every one-pass grid, so the
            # manifest and the cells' keys do not depend on a setting that changes nothing
            object.__setattr__(self, "loop", replace(self.loop, chunk_size=LoopSettings().chunk_size))
        if self.questions is not None and (isinstance(self.questions, bool) or self.questions < 1):
            raise InputError("questions", f"{self.questions} questions per context",
                             "use 1 or more (or leave it out: every question the task asks)")
        _nonempty(self.methods, "methods", "name at least one scorer or scorer+allocator (or full)")
        canon = [m if m == FULL else _canonical_method(m)[0] for m in self.methods]
        refuse_duplicates(canon, "methods", "method")
        if canon != list(self.methods):
            object.__setattr__(self, "methods", tuple(canon))
        for name, values, known in (("modes", self.modes, MODES), ("protocols", self.protocols, PROTOCOLS)):
            for v in values:
                if v not in known:
                    raise InputError(name, f"unknown {name[:-1]} {v!r}", f"use some of: {', '.join(known)}")
            refuse_duplicates(values, name, name[:-1])
        if not self.evicting:
            for name in ("budgets", "modes", "protocols"):
                if getattr(self, name):
                    raise InputError(name, f"the full cache takes no {name} (only `full` is in the methods)",
                                     f"drop the {name} or add an evicting method")
            return
        _nonempty(self.budgets, "budgets", "give at least one budget, e.g. 64 (per cell), 4096total or 2MiB")
        _nonempty(self.modes, "modes", f"use some of: {', '.join(MODES)}")
        _nonempty(self.protocols, "protocols", f"use some of: {', '.join(PROTOCOLS)}")
        budgets = [Budget.parse(b) for b in self.budgets]
        refuse_duplicates([budget_text(b) for b in budgets], "budgets", "budget")
        for b in budgets:
            if b.unit == "tokens_per_cell" and b.value >= min(self.contexts):
                raise InputError("budgets", f"{budget_text(b)} keeps every token of the {min(self.contexts)}-token "
                                 "context: nothing would be evicted", "use budgets below the shortest context")
        self.method_params()  # unknown or bad parameters are refused here
        from evictlab.tasks.examples import HELDOUT_PPL

        checked: set[tuple[str, str, str | None, str]] = set()
        for cell in self.cells():  # each method's config once (parameter values, ...)
            key = (cell.method, cell.mode, cell.budget, cell.protocol)
            if not cell.is_full and key not in checked:
                checked.add(key)
                if cell.decode_config().needs_labels and HELDOUT_PPL in self.tasks:
                    raise InputError("methods", f"{cell.method} reads the task's fact labels and {HELDOUT_PPL} "
                                     "has none", f"drop {HELDOUT_PPL} from the tasks, or {cell.method} from the "
                                     "methods")

    def check_models(self) -> None:
        """Refuse a model that is neither a registry name, a model folder nor a hub id
        (field ``model``), without loading or pulling anything."""
        from evictlab.models.loading import check_model_name

        for m in self.models:
            check_model_name(m, "model")

    # ------------------------------------------------------------------ derived
    @property
    def evicting(self) -> list[str]:
        """The evicting methods (every method but ``full``)."""
        return [m for m in self.methods if m != FULL]

    def method_params(self) -> dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]]:
        """``{method: (scorer params, allocator params)}``: the effective parameters of each
        method, routed like ``decode``'s options (by registry name) with the method's bracket
        parameters over them. Two methods that come to the same parts with the same
        parameters (``snapkv`` with ``--scorer-param window=8`` and ``snapkv[window=8]``) are
        refused (field ``methods``): they would be one arm twice."""
        from evictlab.methods import parse_method_text
        from evictlab.methods.registry import route_params

        parsed = {m: parse_method_text(m) for m in self.evicting}
        sp = route_params(dict(self.scorer_params), [t.scorer for t in parsed.values()], "scorer")
        ap = route_params(dict(self.allocator_params), [t.allocator for t in parsed.values()], "allocator")
        out: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {}
        seen: dict[tuple[Any, ...], str] = {}
        for m, t in parsed.items():
            own = (tuple(sorted({**sp[t.scorer], **dict(t.scorer_params)}.items())),
                   tuple(sorted({**ap[t.allocator], **dict(t.allocator_params)}.items())))
            arm = (t.scorer, t.allocator, *own)
            if arm in seen:
                raise InputError("methods", f"{seen[arm]} and {m} are the same arm (the same scorer, allocator and "
                                 "parameters once the --scorer-param/--allocator-param are routed)",
                                 "list it once, or give the two arms different parameters")
            seen[arm] = m
            out[m] = own
        return out

    def cells(self) -> list[CellSpec]:
        """Every cell, in the grid's order: model, task, context, then the full cell, then
        protocol, budget, method, mode (cells of one (model, task, context) are adjacent,
        so a local run computes each full-cache reference once)."""
        params = self.method_params() if self.evicting else {}
        floors = {(m, t, c) for m, t, c, _ in self.floors}
        out: list[CellSpec] = []
        for model in self.models:
            for task in self.tasks:
                for context in self.contexts:
                    if (model, task, context) in floors:
                        continue  # the full cache cannot do it: nothing for a method to lose
                    base = CellSpec(model=model, task=task, context=context, method=FULL, mode=FULL,
                                    protocol=NO_PROTOCOL, budget=None, n=self.n, seed=self.seed, loop=self.loop,
                                    target_tokens=self.target_tokens, device=self.device, prefill=self.prefill,
                                    questions=self.questions)
                    out.append(base)
                    for protocol in self.protocols:
                        for budget in self.budgets:
                            for method in self.evicting:
                                for mode in self.modes:
                                    if self._skip_reason(task, method, mode, protocol) is None:
                                        sp, ap = params[method]
                                        out.append(replace(base, method=method, mode=mode, protocol=protocol,
                                                           budget=budget, scorer_params=sp, allocator_params=ap,
                                                           trace=self.trace))
        return out

    def units(self) -> list[CellSpec] | list[ContextUnit]:
        """The units of work, in the grid's order: the cells of a ``chunked`` grid; for
        ``one-pass``, one :class:`ContextUnit` per (model, task, context, example), example
        by example (example 0 of every (model, task, context), then example 1, ...): a long
        grid stopped part-way holds the same first examples of every cell, so its partial
        tables compare every arm on the same contexts. Each process keeps the two models it
        used last loaded (:func:`~evictlab.models.loading.load_cached`): a grid of more than
        two models reloads one between units."""
        cells = self.cells()
        if self.prefill != ONE_PASS:
            return cells
        groups: dict[tuple[str, str, int], list[CellSpec]] = {}
        for c in cells:
            groups.setdefault((c.model, c.task, c.context), []).append(c)
        return [ContextUnit(tuple(g), i) for i in range(self.n) for g in groups.values()]

    def skipped(self) -> list[dict[str, str]]:
        """The (task, method, mode, protocol) combinations that are not cells, with why."""
        out = []
        for task in self.tasks:
            for protocol in self.protocols:
                for method in self.evicting:
                    for mode in self.modes:
                        why = self._skip_reason(task, method, mode, protocol)
                        if why:
                            out.append({"task": task, "method": method, "mode": mode, "protocol": protocol,
                                        "reason": why})
        return out

    @staticmethod
    def _skip_reason(task: str, method: str, mode: str, protocol: str) -> str | None:
        from evictlab.tasks.examples import HELDOUT_PPL

        if task == HELDOUT_PPL and protocol == "query-aware":
            return "a perplexity window has no question to be aware of"
        if mode == "uniform" and _canonical_method(method)[2] == "uniform":
            return "the allocator is already uniform: the uniform mode is the physical run"
        return None

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("models", "tasks", "contexts", "methods", "budgets", "modes", "protocols"):
            d[k] = list(d[k])
        if self.floors:
            d["floors"] = [list(f) for f in self.floors]
        else:  # manifests of grids without the suite are unchanged by the field
            del d["floors"]
        d["scorer_params"] = dict(self.scorer_params)
        d["allocator_params"] = dict(self.allocator_params)
        if not self.trace:  # manifests of untraced grids are unchanged by the option
            del d["trace"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GridSpec:
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise InputError("manifest", f"unknown grid fields {extra}", "rerun with this version of evictlab")
        kw = dict(d)
        kw["loop"] = LoopSettings(**kw.get("loop", {}))
        for k in ("models", "tasks", "contexts", "methods", "budgets", "modes", "protocols"):
            kw[k] = tuple(kw.get(k, ()))
        kw["floors"] = tuple((str(m), str(t), int(c), str(r)) for m, t, c, r in kw.get("floors", ()))
        kw["scorer_params"] = tuple(sorted(dict(kw.get("scorer_params", {})).items()))
        kw["allocator_params"] = tuple(sorted(dict(kw.get("allocator_params", {})).items()))
        return cls(**kw)

    def differences(self, other: GridSpec) -> list[str]:
        """Human-readable ``field: this vs other`` for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {b[k]!r} there vs {a[k]!r} now" for k in a if a[k] != b.get(k)]
