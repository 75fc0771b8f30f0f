"""Atomic file output and content hashes.

Every stage output goes through these helpers: a crash or an interruption leaves either the old file or
the new one, never a half-written file that DVC would accept as an output.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class OutputError(OSError):
    """An output cannot be written where it was asked for (a directory in a file's place, a parent that is a file, a
    folder without write permission, ...). The message is one line naming the path and why; nothing of the output
    (no temporary sibling, no partial file) is left behind."""


def _refusal(path: Path, exc: OSError | None = None, *, directory: bool = False) -> OutputError:
    """The :class:`OutputError` for the output ``path`` (a directory if ``directory``): what stands in its way, else
    ``exc``, the error that creating or renaming it raised."""
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    fix = "move it aside or choose another output path"
    if blocker is not None:
        why = f"{blocker} is a file, not a directory"
    elif path.is_dir() and not directory:
        why = "a directory of that name is in the way"
    elif path.exists() and not path.is_dir() and directory:
        why = "a file of that name is in the way"
    elif isinstance(exc, PermissionError):
        folder = next((p for p in path.parents if p.is_dir()), path.parent)
        why, fix = f"no permission to write in {folder}", "make it writable or choose another output path"
    else:
        why, fix = (exc.strerror or str(exc)) if exc else "unknown reason", "choose another output path"
    return OutputError(f"cannot write {path}: {why}; {fix}")


def _temp_beside(path: Path, make: Any, *, directory: bool = False) -> Any:
    """``make(prefix=, suffix=, dir=)`` (mkstemp / mkdtemp) beside ``path``; clear :class:`OutputError` if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return make(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _refusal(path, exc, directory=directory) from exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    Raises :class:`OutputError` before the block if ``path`` cannot be written (a directory in its place, a parent
    that is a file, a folder without write permission), or after it if the rename fails; either way the temporary
    file is removed and ``path`` is left as it was."""
    path = Path(path)
    if path.is_dir():  # before the block: fail before the work of making the output
        raise _refusal(path)
    fd, tmp = _temp_beside(path, tempfile.mkstemp)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        try:
            if tmp_path.exists():  # mkstemp creates 0600; give the output the usual umask-derived mode
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp_path, 0o666 & ~umask)
            os.replace(tmp_path, path)
        except OSError as exc:
            raise _refusal(path, exc) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def json_safe(obj: Any) -> Any:
    """``obj`` made storable as strict JSON (what DVC reads), recursively through mappings, lists and tuples.

    Non-finite floats become the strings ``'inf'``, ``'-inf'``, ``'nan'``; numpy scalars become Python ones;
    tuples become lists and mapping keys strings. Anything else is returned as it is.
    """
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else str(v)
    return obj


def csv_text(
    rows: Iterable[Mapping[str, Any] | Sequence[Any]],
    columns: Sequence[str] | None = None,
    fmt: Callable[[Any], str] | None = None,
) -> str:
    """CSV text with ``\\n`` line ends: a header line of ``columns``, then one line per row.

    A row is a mapping (its cells looked up by column: a missing key is an empty cell, a key outside ``columns``
    is left out) or a sequence of cells in column order. ``columns`` defaults to the first row's keys. A ``None``
    cell is empty; any other cell is ``fmt(cell)`` if ``fmt`` is given, else the csv module's text of it.
    """
    rows = list(rows)
    if columns is None:
        if not rows or not isinstance(rows[0], Mapping):
            raise ValueError("csv_text needs columns unless the first row is a mapping")
        columns = list(rows[0])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        cells = [row.get(c) for c in columns] if isinstance(row, Mapping) else row
        writer.writerow(["" if v is None else (fmt(v) if fmt else v) for v in cells])
    return buf.getvalue()


def write_csv(
    path: str | os.PathLike,
    rows: Iterable[Mapping[str, Any] | Sequence[Any]],
    columns: Sequence[str] | None = None,
    fmt: Callable[[Any], str] | None = None,
) -> None:
    """:func:`csv_text` written atomically to ``path``."""
    write_text(path, csv_text(rows, columns, fmt))


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    import torch  # here: the commands that touch no tensors (check, ui) start without torch's 1.2 s

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


class TensorFileError(ValueError):
    """A file meant to hold tensors is truncated, not a torch file, or holds Python objects besides tensors."""


def load_torch(path: str | os.PathLike) -> Any:
    """Load a tensor file written by :func:`save_torch`; never unpickles arbitrary objects.

    Raises :class:`TensorFileError` (one line naming ``path``) for a file that is corrupt or holds anything but
    tensors and plain containers; ``FileNotFoundError`` if it does not exist.
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:  # weights_only refused a global (code), or the pickle stream is garbage
        raise TensorFileError(f"{path} holds Python objects other than tensors, or is corrupt; it was refused "
                              "unread (files are loaded weights-only, pickled code never runs)") from exc
    except Exception as exc:  # truncated zip archive, not a torch file at all, ...
        first = str(exc).split(". ")[0].strip().rstrip(".")
        raise TensorFileError(f"{path} is truncated or not a PyTorch tensor file ({first})") from exc


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory in a temporary sibling and swap it in whole when the block succeeds.

    A crashed build leaves the previous directory (or none) in place. Raises :class:`OutputError` before the block
    if ``path`` cannot be written (a file in its place, a parent that is a file, a folder without write permission),
    or after it if the swap fails (the previous directory put back); the temporary directory is removed either way.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise _refusal(path, directory=True)
    tmp = Path(_temp_beside(path, tempfile.mkdtemp, directory=True))
    try:
        yield tmp
        old = None
        try:
            if path.exists():
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                os.replace(path, old)
            os.replace(tmp, path)
        except OSError as exc:
            if old is not None and not path.exists():
                os.replace(old, path)
            raise _refusal(path, exc, directory=True) from exc
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
