"""Training sequences for retention gates: text windows and synthetic tasks, by step.

Sequence ``j`` of step ``s`` is a pure function of ``(seed, s, j)`` (its generator is
``numpy.random.default_rng([seed, s, j])``), so a resumed run sees exactly the batches an
uninterrupted one sees, with no data-loader state to save.

- With probability ``text_fraction`` it is a window of exactly ``seq_len`` tokens of the
  text source (default ``shakespeare``: the plays cut at the held-out boundary of
  :func:`evictlab.tasks.corpus.heldout_split`, so held-out perplexity stays held out;
  ``file:PATH`` / ``jsonl:PATH:FIELD`` for your own text), drawn like capture's prompts
  (:func:`evictlab.tasks.texts.text_window`) from a document picked by the generator.
- Otherwise a synthetic task (:func:`evictlab.tasks.synthetic.make_task`: needle,
  multi_needle, multi_key, variable_tracking), tokenised as the decode loop feeds it
  (context, ``"\\n\\n" + question``, ``" " + answer``), its context fitted so the whole is at
  most ``seq_len`` tokens. Its task seed is ``TASK_SEED_BASE + seed x 10^9 + s x 1000 + j``:
  at least 10^15, so never one of the evaluation suites' seeds (``seed x 1_000_003 + i``
  for the small seeds evaluation uses).

Shorter sequences are right-padded; :meth:`TrainingData.batch` returns the real lengths
(the losses leave padding out).

Training draws from a fixed pool (:meth:`TrainingData.pool`), so the teacher's outputs are
computed once per sequence (:mod:`evictlab.gates.teacher`): the training pool is the
sequences ``(0, j)``, ``j < n_pool``, the validation set the sequences ``(1, j)``,
``j < n_val`` (other draws from the same sources: held out from the training draws, not
from the text). Step ``s`` trains on draws ``s x batch .. s x batch + batch - 1``; draw
``d`` is pool entry ``perm_e[d mod n_pool]`` with ``e = d // n_pool`` the epoch and
``perm_e`` a permutation drawn from ``default_rng([seed, 2, e])`` (:func:`step_indices`):
every epoch visits each pool entry once, and a step's batch is a function of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from evictlab.errors import InputError, refuse_duplicates

__all__ = ["MAX_POOL", "MIN_TASK_SEQ_LEN", "POOL_STREAM", "TASK_SEED_BASE", "VAL_STREAM", "DataSpec", "TrainingData",
           "step_indices"]

TASK_SEED_BASE = 10 ** 15
#: Shortest sequence that holds a task: 64 context tokens plus question and answer.
MIN_TASK_SEQ_LEN = 192
#: The ``step`` argument of :meth:`TrainingData.sequence` that names the training pool and
#: the validation set (their task seeds stay distinct while ``j < 1000``).
POOL_STREAM, VAL_STREAM = 0, 1
#: Largest pool or validation set (sequence ``j`` of a stream has task seed ``... + j``, ``j < 1000``).
MAX_POOL = 999


@dataclass(frozen=True)
class DataSpec:
    """What the gates are trained on (recorded in gates.json)."""

    seq_len: int = 256
    text: str = "shakespeare"
    text_fraction: float = 0.5
    tasks: tuple[str, ...] = ("needle", "multi_needle", "multi_key", "variable_tracking")

    def __post_init__(self) -> None:
        from evictlab.tasks.synthetic import TASKS
        from evictlab.tasks.texts import is_text_source

        if self.seq_len < 16:
            raise InputError("--seq-len", f"{self.seq_len} tokens is too short", "use at least 16 (256 in the recipe)")
        if not 0.0 <= self.text_fraction <= 1.0:
            raise InputError("--text-fraction", f"{self.text_fraction} is not in [0, 1]", "use e.g. 0.5")
        if not is_text_source(self.text):
            raise InputError("--source", f"unknown text source {self.text!r}", "use shakespeare, file:PATH or jsonl:PATH:FIELD")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or (self.text_fraction < 1.0 and not self.tasks):
            raise InputError("--tasks", f"unknown task(s) {bad}" if bad else "no task given",
                             f"use some of: {', '.join(TASKS)}")
        refuse_duplicates(self.tasks, "--tasks", "task")
        if self.text_fraction < 1.0 and self.seq_len < MIN_TASK_SEQ_LEN:
            raise InputError("--seq-len", f"{self.seq_len} tokens cannot hold a synthetic task",
                             f"use --seq-len {MIN_TASK_SEQ_LEN} or more, or --text-fraction 1")

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "text": self.text, "text_fraction": self.text_fraction,
                "tasks": list(self.tasks), "task_seed_base": TASK_SEED_BASE,
                "text_rule": "Shakespeare plays before the held-out boundary" if self.text == "shakespeare"
                else "the whole source"}


class TrainingData:
    """The sequences of a run (see the module docstring). ``tokenizer`` is a Hugging Face
    tokenizer (or :class:`evictlab.capture.testing.ByteTokenizer` for the tiny models)."""

    def __init__(self, tokenizer: Any, spec: DataSpec, seed: int) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.seed = int(seed)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self._docs: Sequence[Any] | None = None

    def _documents(self) -> Sequence[Any]:
        if self._docs is None:
            from evictlab.tasks.texts import load_text_source

            self._docs = load_text_source(self.spec.text).documents
        return self._docs

    def text_ids(self, rng: np.random.Generator) -> list[int]:
        """A window of exactly ``seq_len`` tokens from a document the generator picks."""
        from evictlab.tasks.texts import text_window

        docs = self._documents()
        first = int(rng.integers(len(docs)))
        for k in range(len(docs)):
            win = text_window(self.tokenizer, docs[(first + k) % len(docs)], self.spec.seq_len, rng)
            if win is not None:
                return win[0]
        raise InputError("--seq-len", f"{self.spec.seq_len} tokens is longer than every document of {self.spec.text}",
                         "use a shorter --seq-len or a longer text")

    def task_ids(self, rng: np.random.Generator, task_seed: int) -> list[int]:
        """A synthetic task (context + question + answer), at most ``seq_len`` tokens."""
        from evictlab.tasks.synthetic import make_task
        from evictlab.tasks.examples import tokenize_task, encode_text

        task = self.spec.tasks[int(rng.integers(len(self.spec.tasks)))]
        probe = make_task(task, self.spec.seq_len, self.tokenizer, task_seed, field="--seq-len")  # question, answer
        qa = (encode_text(self.tokenizer, "\n\n" + probe.question, special=False)
              + encode_text(self.tokenizer, " " + probe.answer, special=False))
        room = self.spec.seq_len - len(qa)
        if room < 64:
            raise InputError("--seq-len", f"{self.spec.seq_len} tokens leave {room} for a {task} context",
                             f"use --seq-len {self.spec.seq_len + 64 - room} or more, or --text-fraction 1")
        p = tokenize_task(make_task(task, room, self.tokenizer, task_seed, field="--seq-len"), self.tokenizer)
        ids = p.context_ids + qa
        return ids[: self.spec.seq_len]

    def sequence(self, step: int, j: int) -> tuple[list[int], str]:
        """``(ids, kind)`` of sequence ``j`` of ``step``; ``kind`` is ``"text"`` or the task."""
        rng = np.random.default_rng([self.seed, int(step), int(j)])
        if rng.random() < self.spec.text_fraction:
            return self.text_ids(rng), "text"
        task_seed = TASK_SEED_BASE + self.seed * 10 ** 9 + int(step) * 1000 + int(j)
        return self.task_ids(rng, task_seed), "task"

    def batch(self, step: int, size: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (size, seq_len) int64 right-padded, lengths (size,) int64)`` of ``step``."""
        seqs = [self.sequence(step, j)[0] for j in range(size)]
        T = self.spec.seq_len
        ids = torch.full((size, T), self.pad_id, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        return ids.to(device), lengths.to(device)

    def pool(self, n_pool: int, n_val: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (n_pool + n_val, seq_len) int64, lengths (n_pool + n_val,))``: the training
        pool's sequences, then the validation set's (module docstring)."""
        if not (0 < n_pool <= MAX_POOL and 0 <= n_val <= MAX_POOL):
            raise InputError("--pool", f"pool {n_pool} / validation {n_val} sequences",
                             f"use 1 to {MAX_POOL} pool and 0 to {MAX_POOL} validation sequences")
        seqs = ([self.sequence(POOL_STREAM, j)[0] for j in range(n_pool)]
                + [self.sequence(VAL_STREAM, j)[0] for j in range(n_val)])
        T = self.spec.seq_len
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
        return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long)


def step_indices(seed: int, step: int, batch: int, n_pool: int) -> list[int]:
    """The pool entries step ``step`` trains on (``batch`` of them; module docstring)."""
    out = []
    perms: dict[int, np.ndarray] = {}
    for d in range(step * batch, step * batch + batch):
        e = d // n_pool
        if e not in perms:
            perms[e] = np.random.default_rng([int(seed), 2, e]).permutation(n_pool)
        out.append(int(perms[e][d % n_pool]))
    return out
