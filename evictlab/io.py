"""Files: atomic writes, checksums, guarded reads, output-path checks and write locks.

* Writes go to a temporary file in the destination folder, are flushed and fsynced, then
  renamed over the destination, so a crash never leaves a half-written file under the final
  name (``os.replace`` is atomic on POSIX within one filesystem).
* Reads of our own files (:func:`read_json`, :func:`read_parquet`, :func:`load_npz`) turn
  any decoding failure into one :class:`~evictlab.errors.CorruptFileError` naming the file.
* Parquet files evictlab writes and reads back (part files, results tables, traces) carry
  their own checksum (:func:`write_checked_parquet`, :func:`read_checked_parquet`,
  :func:`check_parquet`): a damaged file is named in one line, never read as if intact.
* :func:`check_output_path` applies the one rule for outputs (the parent folder must exist;
  a file is not a directory), and :func:`exclusive_lock` refuses a second writer at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from evictlab.errors import CorruptFileError, EvictlabError, InputError


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; rename it onto ``dest`` on success.

    The caller writes the file at the yielded path (any library, any format). On an
    exception the temporary file is removed and ``dest`` is left untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The name is drawn before the file exists and the file is created inside ``try``, so a
    # Ctrl-C at any point after creation still removes it (tempfile.mkstemp creates the file
    # before its name reaches us, and an interrupt in between left it behind). 64 random bits:
    # a second writer drawing the same name (whose file ``finally`` would remove) is not a risk.
    while True:
        tmp_path = dest.parent / f".{dest.name}.{secrets.token_hex(8)}{suffix}.tmp"
        if not tmp_path.exists():
            break
    try:
        os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        # The file was created 0600; give the result the mode a plain open() would have.
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def remove_temp_files(folder: str | os.PathLike[str], dests: tuple[str, ...]) -> None:
    """Delete the temporary files that interrupted :func:`atomic_path` writes of the
    destinations named ``dests`` (file names, or name prefixes ending in ``-``) left in
    ``folder``: ``.<dest name>.<random><suffix>.tmp``. Call it only while holding the
    destinations' write lock; other files are never touched."""
    prefixes = tuple(f".{d}" if d.endswith("-") else f".{d}." for d in dests)
    for f in Path(folder).iterdir():
        if f.name.startswith(prefixes) and f.name.endswith(".tmp"):
            f.unlink(missing_ok=True)


def _umask() -> int:
    """The process umask (os.umask can only be read by setting it, so set it back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(dest: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``dest`` atomically."""
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(dest: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``dest`` atomically."""
    atomic_write_bytes(dest, text.encode("utf-8"))


def atomic_write_json(dest: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``dest`` atomically."""
    atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def write_npz(dest: str | os.PathLike[str], arrays: dict[str, Any]) -> None:
    """Write numpy ``arrays`` as an uncompressed ``.npz`` atomically, byte-reproducibly.

    ``numpy.savez`` stamps each member with the current time, so equal arrays give
    different files; here every member gets a fixed timestamp and the members are written
    in sorted name order, so equal arrays give byte-identical files (and equal SHA-256).
    """
    import zipfile

    import numpy as np

    with atomic_path(dest, suffix=".npz") as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name in sorted(arrays):
                info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
                with zf.open(info, "w", force_zip64=True) as fh:
                    np.lib.format.write_array(
                        fh, np.ascontiguousarray(arrays[name]), allow_pickle=False
                    )


# --------------------------------------------------------------------------------------
# Guarded reads: any decoding failure becomes one CorruptFileError naming the file
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _decoding(path: Path, what: str, fix: str) -> Iterator[None]:
    """Turn every failure to decode ``path`` into :class:`CorruptFileError`.

    Decoders fail in many ways on damaged bytes: ``OSError``, ``ValueError``,
    ``zipfile.BadZipFile``, ``EOFError``, ``MemoryError`` (a damaged length field),
    polars' ``ComputeError``, pyarrow's ``ArrowInvalid``, and Rust panics surfaced by pyo3
    as ``PanicException``, which derives from ``BaseException``. So everything is caught
    except the exceptions that stop a program on purpose.
    """
    try:
        yield
    except FileNotFoundError:
        raise CorruptFileError(str(path), "is missing", fix) from None
    except (KeyboardInterrupt, SystemExit, GeneratorExit, EvictlabError):
        raise
    except BaseException as exc:  # noqa: BLE001 -- see the docstring
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CorruptFileError(str(path), f"cannot be read as {what} ({type(exc).__name__}"
                               f"{': ' + msg[:200] if msg else ''})", fix) from None


def read_json(path: str | os.PathLike[str], fix: str) -> Any:
    """Parse the UTF-8 JSON file ``path``; any failure is a :class:`CorruptFileError`."""
    path = Path(path)
    with _decoding(path, "JSON", fix):
        return json.loads(path.read_text(encoding="utf-8"))


def read_parquet(path: str | os.PathLike[str], fix: str) -> Any:
    """Read the Parquet file ``path`` into a polars frame; any failure (including a
    polars panic) is a :class:`CorruptFileError` naming ``path`` and ``fix``."""
    import polars as pl

    path = Path(path)
    with _decoding(path, "Parquet", fix):
        return pl.read_parquet(path)


def load_npz(path: str | os.PathLike[str], fix: str) -> dict[str, Any]:
    """All arrays of the ``.npz`` file ``path`` (no pickles); any failure is a
    :class:`CorruptFileError`."""
    import numpy as np

    path = Path(path)
    with _decoding(path, ".npz arrays", fix):
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}


# --------------------------------------------------------------------------------------
# Checksummed Parquet: the SHA-256 of the file's own bytes, stored in its footer
# --------------------------------------------------------------------------------------

#: Key of the file-level key-value metadata entry holding a checked Parquet file's digest.
PARQUET_DIGEST_KEY = "evictlab.sha256"
_PLACEHOLDER = b"0" * 64
# The entry as the footer (Thrift compact protocol) stores it: a binary field of 15 bytes
# (the key), then a binary field of 64 bytes (the hex digest).
_DIGEST_HEAD = b"\x18\x0f" + PARQUET_DIGEST_KEY.encode() + b"\x18\x40"
_DIGEST_FIELD = re.compile(re.escape(_DIGEST_HEAD))
# The same 19 bytes with any one byte changed: what a single flipped bit leaves of the
# entry's head, so a damaged entry never reads as a file that has none.
_DIGEST_NEAR = re.compile(b"|".join(re.escape(_DIGEST_HEAD[:i]) + b"." + re.escape(_DIGEST_HEAD[i + 1:])
                                    for i in range(len(_DIGEST_HEAD))), re.DOTALL)
_TAIL_MARGIN = 1 << 16  # bytes searched before the footer, in case its length field is damaged

#: What :func:`read_checked_parquet` does with a file that carries no digest (written by an
#: evictlab older than the checksums): read it with a one-line warning, or refuse it.
Legacy = Literal["warn", "refuse"]


def write_checked_parquet(df: Any, dest: str | os.PathLike[str], **write_options: Any) -> str:
    """Write the polars frame ``df`` as Parquet at ``dest`` (atomically) with its checksum;
    return the checksum (hex SHA-256).

    The checksum is the SHA-256 of the whole file with the 64 bytes of the checksum itself
    read as ASCII zeros; it is stored in the file's own footer, in the key-value metadata
    entry :data:`PARQUET_DIGEST_KEY`. A whole-file digest covers every byte: each data
    page and page header, the schema and statistics in the footer, the footer length and
    the magic bytes, so any single flipped bit is detected (a page CRC would cover the
    pages only, a digest of the decoded table would miss footer bytes such as statistics
    that do not change the decoded values). Same frame, same options: same bytes.
    """
    dest = Path(dest)
    with atomic_path(dest, suffix=".parquet") as tmp:
        df.write_parquet(tmp, metadata={PARQUET_DIGEST_KEY: _PLACEHOLDER.decode()}, **write_options)
        at = _digest_offset(tmp)
        if at is None:  # polars' (experimental) metadata argument stopped storing the entry
            raise RuntimeError(f"polars did not store the {PARQUET_DIGEST_KEY} metadata entry in {dest}")
        digest = _masked_sha256(tmp, at)
        with open(tmp, "r+b") as fh:
            fh.seek(at)
            fh.write(digest.encode())
    return digest


def _digest_offset(path: Path) -> int | None:
    """File offset of the 64 checksum bytes of a checked Parquet file; None if the file has
    no checksum entry; :class:`CorruptFileError` if it is not a complete Parquet file or its
    entry is damaged (part of it is there, the whole is not)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size < 12:
            raise CorruptFileError(str(path), f"is not a complete Parquet file ({size} bytes)", "")
        fh.seek(size - 8)
        tail8 = fh.read(8)
        footer_len = struct.unpack("<i", tail8[:4])[0]
        if tail8[4:] != b"PAR1" or not 0 < footer_len <= size - 12:
            raise CorruptFileError(str(path), "is not a complete Parquet file (bad footer)", "")
        start = max(0, size - 8 - footer_len - _TAIL_MARGIN)
        fh.seek(start)
        tail = fh.read(size - start)
    hits = [m.end() for m in _DIGEST_FIELD.finditer(tail)]
    if len(hits) == 1 and hits[0] + 64 <= len(tail) - 8:
        return start + hits[0]
    if hits or _DIGEST_NEAR.search(tail):
        raise CorruptFileError(str(path), "has a damaged checksum entry in its footer", "")
    return None


def _masked_sha256(path: Path, at: int, chunk: int = 1 << 20) -> str:
    """SHA-256 of the file at ``path`` with bytes ``[at, at + 64)`` read as ASCII zeros."""
    h = hashlib.sha256()
    pos = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            lo, hi = max(at - pos, 0), min(at + 64 - pos, len(block))
            if lo < hi:
                block = block[:lo] + _PLACEHOLDER[lo + pos - at:hi + pos - at] + block[hi:]
            h.update(block)
            pos += len(block)
    return h.hexdigest()


def check_parquet(path: str | os.PathLike[str], fix: str) -> bool:
    """Verify the checksum of a Parquet file written by :func:`write_checked_parquet`.

    True: intact. False: the file carries no checksum (written by an evictlab older than
    the checksums; see :func:`read_checked_parquet`). :class:`CorruptFileError` naming
    ``path`` and ``fix``: missing, not a complete Parquet file, or any byte changed since
    it was written.
    """
    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(str(path), "is missing", fix)
    try:
        at = _digest_offset(path)
    except CorruptFileError as exc:
        raise CorruptFileError(str(path), exc.problem, fix) from None
    if at is None:
        return False
    with open(path, "rb") as fh:
        fh.seek(at)
        stored = fh.read(64)
    if _masked_sha256(path, at).encode() != stored:
        raise CorruptFileError(str(path), "fails its checksum (damaged or changed after it was written)", fix)
    return True


def warn(line: str) -> None:
    """Print a one-line warning on stderr (the default ``notify`` of the checked readers)."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def read_checked_parquet(path: str | os.PathLike[str], fix: str, *, legacy: Legacy = "warn",
                         notify: Callable[[str], None] | None = None) -> Any:
    """Read a Parquet file written by :func:`write_checked_parquet` into a polars frame,
    after verifying its checksum (:func:`check_parquet`); any failure is a
    :class:`CorruptFileError` naming ``path`` and ``fix``.

    A file without a checksum (an older evictlab wrote it): ``legacy="warn"`` reads it,
    unverified, after one warning line (``notify``, default :func:`warn` on stderr);
    ``legacy="refuse"`` refuses it (resumable part files: the caller recomputes them).
    """
    path = Path(path)
    if not check_parquet(path, fix):
        if legacy == "refuse":
            raise CorruptFileError(str(path), "carries no checksum (written by an older evictlab), so it cannot "
                                   "be verified", fix)
        (notify or warn)(f"{path} carries no checksum (written by an older evictlab); it is read unverified. "
                         f"To check it, {fix}")
    return read_parquet(path, fix)


def check_sha256(path: str | os.PathLike[str], expected: str, fix: str) -> None:
    """Raise :class:`CorruptFileError` unless ``path`` exists and has SHA-256 ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(str(path), "is missing", fix)
    if sha256_file(path) != expected:
        raise CorruptFileError(str(path), "fails its SHA-256 checksum (damaged or replaced "
                               "after it was written)", fix)


# --------------------------------------------------------------------------------------
# Output paths and locks
# --------------------------------------------------------------------------------------


def check_output_path(path: str | os.PathLike[str], option: str, *, directory: bool) -> Path:
    """Check an output path before anything is written; return it as a :class:`Path`.

    The rule for every output: its parent folder must already exist (a typo in a path
    never creates a stray tree of folders), and it must be of the right kind if it exists
    (a dataset directory, ``directory=True``, or a file). ``option`` names the CLI option.
    """
    path = check_parent(path, option)
    if directory and path.exists() and not path.is_dir():
        raise InputError(option, f"{path} is a file, not a dataset directory",
                         f"choose a new directory name for {option} (or remove that file)")
    if not directory and path.is_dir():
        raise InputError(option, f"{path} is a directory, not a file",
                         f"pass a file path for {option}, e.g. {path / 'results.parquet'}")
    return path


#: Bytes a generator may write unless ``--max-gib`` raises it (``rows synth``, ``capture``,
#: ``rows export``): 4 GiB, about ten times the paper-scale dataset.
DEFAULT_MAX_GIB = 4.0


def check_output_size(need: int, max_gib: float, what: str, fix: str, option: str = "--max-gib") -> None:
    """Refuse, before any work, an output estimated at ``need`` bytes above ``max_gib`` GiB
    (:class:`InputError` on ``option``; ``what`` names the output, ``fix`` what to change);
    also refuse a ``max_gib`` that is not positive."""
    if not max_gib > 0:
        raise InputError("--max-gib", f"must be > 0, got {max_gib}", "pass e.g. --max-gib 4")
    if need > max_gib * 2**30:
        raise InputError(option, f"{what} would take about {need / 2**30:,.1f} GiB, above the --max-gib limit of "
                         f"{max_gib:g} GiB", fix)


def check_parent(path: str | os.PathLike[str], option: str) -> Path:
    """Raise :class:`InputError` naming ``option`` unless ``path``'s parent folder exists."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise InputError(option, f"the parent folder {parent} of {path} {what}",
                         f"create the folder first (mkdir -p {parent}) or choose another {option}")
    return path


def lock_path_for(target: str | os.PathLike[str]) -> Path:
    """The lock file guarding writes to ``target``: ``.<name>.lock`` in the same folder."""
    target = Path(target)
    return target.with_name(f".{target.name}.lock")


@dataclass
class _Held:
    pid: int        # process that took the lock (a forked child does not hold it)
    owner: int      # thread id
    count: int
    fd: int


_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


class FileLock:
    """An exclusive, non-blocking lock on a lock file (``fcntl.flock``), held by one writer.

    A second process (or another thread) that asks for it is refused at once with an
    :class:`InputError` naming ``option`` and the process holding it; it never waits. The
    lock is re-entrant in the thread that holds it (a command may take it, then call a
    library function that takes it again). It dies with its process, so a killed run
    never leaves a stale lock, only a harmless lock file that the next run reuses. The
    lock file is removed on release.
    """

    def __init__(self, target: str | os.PathLike[str], option: str) -> None:
        self.target = Path(target)
        self.path = lock_path_for(self.target)
        self.option = option
        self._key: str | None = None

    def _busy(self) -> InputError:
        try:
            pid = self.path.read_text().strip() or "?"
        except OSError:
            pid = "?"
        return InputError(self.option, f"{self.target} is being written by another evictlab run "
                          f"(pid {pid}; lock file {self.path})",
                          f"wait for that run to finish (or stop it), or choose another {self.option}")

    def acquire(self) -> FileLock:
        """Take the lock, or raise :class:`InputError` if another process/thread holds it."""
        import fcntl

        if self._key is not None:
            return self
        check_parent(self.target, self.option)
        key = str(self.path.resolve())
        me = threading.get_ident()
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is not None and held.pid != os.getpid():
                del _HELD[key]  # inherited through fork: the parent's lock, not ours
                held = None
            if held is not None:
                if held.owner != me:
                    raise self._busy()
                held.count += 1
                self._key = key
                return self
            for _ in range(8):
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                except OSError as exc:
                    raise InputError(self.option, f"cannot create the lock file {self.path} "
                                     f"({exc.strerror})", f"choose an {self.option} in a folder "
                                     "you can write to") from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    raise self._busy() from None
                # The previous holder unlinks the file on release; if that happened between
                # our open and flock, we hold a lock on a deleted file: start over.
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                _HELD[key] = _Held(os.getpid(), me, 1, fd)
                self._key = key
                return self
        raise self._busy()

    def release(self) -> None:
        """Release the lock (the last release in the holding thread removes the file)."""
        if self._key is None:
            return
        with _HELD_GUARD:
            held = _HELD.get(self._key)
            if held is None or held.pid != os.getpid():  # not ours (e.g. after a fork)
                self._key = None
                return
            held.count -= 1
            if held.count == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # unlink while still locked, then unlock
                os.close(held.fd)
                del _HELD[self._key]
        self._key = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def exclusive_lock(target: str | os.PathLike[str], option: str = "--out") -> FileLock:
    """The write lock of ``target`` (a file or dataset directory), to use as
    ``with exclusive_lock(out, "--out"): ...``; see :class:`FileLock`."""
    return FileLock(target, option)


def check_output_file(path: str | os.PathLike[str], option: str, *, overwrite: bool) -> Path:
    """Refuse, before any work, an output file path that would fail or clobber something.

    :func:`check_output_path`'s rule (the folder must exist, a directory is not a file)
    plus, without ``overwrite``, an existing file is refused with an
    :class:`~evictlab.errors.InputError` naming ``option`` (e.g. ``"--out"``).
    """
    path = check_output_path(path, option, directory=False)
    if path.exists() and not overwrite:
        raise InputError(option, f"{path} already exists",
                         f"pass --overwrite to replace it, or choose another {option}")
    return path
