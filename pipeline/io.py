"""Atomic file output and content hashes.

Every stage output goes through these helpers: a crash or an interruption leaves either the old file or
the new one, never a half-written file that DVC would accept as an output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class OutputError(OSError):
    """An output cannot be created where it was asked for (a parent is a file, no permission, ...)."""


def _temp_beside(path: Path, make: Any) -> Any:
    """``make(prefix=, suffix=, dir=)`` (mkstemp / mkdtemp) beside ``path``; clear :class:`OutputError` if not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return make(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else (exc.strerror or str(exc))
        raise OutputError(f"cannot write {path}: {why}; choose another output path") from exc


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    fd, tmp = _temp_beside(path, tempfile.mkstemp)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():  # mkstemp creates 0600; give the output the usual umask-derived mode
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


class TensorFileError(ValueError):
    """A file meant to hold tensors is truncated, not a torch file, or holds Python objects besides tensors."""


def load_torch(path: str | os.PathLike) -> Any:
    """Load a tensor file written by :func:`save_torch`; never unpickles arbitrary objects.

    Raises :class:`TensorFileError` (one line naming ``path``) for a file that is corrupt or holds anything but
    tensors and plain containers; ``FileNotFoundError`` if it does not exist.
    """
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

    A crashed build leaves the previous directory (or none) in place.
    """
    path = Path(path)
    tmp = Path(_temp_beside(path, tempfile.mkdtemp))
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
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
