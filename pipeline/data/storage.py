"""What every node of a Ray cluster shares: the run storage (``ray.storage_path``), and what we keep there.

Ray Train already requires ``ray.storage_path`` to be storage every node sees (an NFS/EFS mount at the same path
on every node, or a URI such as ``s3://bucket/prefix``): checkpoints go there. The driver therefore *stages* the
prepared data there too, content-addressed by the manifest's file digests::

    <storage>/prepared-data/<digest>/{manifest.json, train_x.npy, train_y.npy, test_x.npy, test_y.npy}

and every worker loads it from there, after checking that the copy it sees is the one the driver saw (the file
digests of its manifest, then each file's sha256). A worker on a node that does not see the storage fails with a
message naming its node and the path, instead of training on a stale local copy or dying in a traceback. On one
machine with local storage the staged copy is a hard link when the file system allows (no second copy). A worker
whose training set exceeds its data budget maps the files (``fetch_prepared(..., mmap=True)``) instead of reading
them: on shared storage every worker of a node then shares the same pages, and reads only the rows it trains on.

Also here: what a worker leaves for the driver in the Ray run directory (:data:`STATUS_FILE`, :data:`PLACEMENT_FILE`),
readable wherever the run directory lives.

pyarrow's file systems (a Ray dependency) for URIs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline.config.names import data_digest
from pipeline.data.prepared import MANIFEST, PREPARED_FILES, load_prepared
from pipeline.data.types import Dataset, DatasetError

if TYPE_CHECKING:
    from pyarrow import fs as pafs

STAGED = "prepared-data"
STATUS_FILE = "transfusion_status.json"
PLACEMENT_FILE = "transfusion_workers.json"  # where each rank trains
CACHE_ENV = "TRANSFUSION_DATA_CACHE"  # where workers keep downloads of remote staged data (default: the temp dir)


class StorageError(RuntimeError):
    """``ray.storage_path`` cannot hold the run storage (a path under a regular file, no permission, ...)."""


def check_storage(storage: str) -> None:
    """Fail fast, before Ray starts, when a local ``ray.storage_path`` cannot be a directory: one paragraph naming the
    key, the path and the reason, instead of an ``OSError`` traceback from the first write. Creates nothing: the
    nearest existing directory on the path must be writable, and nothing on the way a file. (A URI's bucket is
    checked by its first write.)"""
    if is_uri(storage):
        return
    path = Path(storage).absolute()
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        why = f"{existing} is a file, not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"no permission to write in {existing}" if existing != path else "no permission to write there"
    else:
        return
    raise StorageError(f"ray.storage_path: {storage} cannot hold the run storage ({why}); point ray.storage_path "
                       "at a directory this machine can write and, on a cluster, every node sees (an NFS/EFS "
                       "mount or s3://bucket/prefix)")


def is_uri(path: str) -> bool:
    return "://" in path


def join(base: str, *parts: str) -> str:
    """Join path parts onto a local path or a URI (``s3://b/p`` + ``x`` -> ``s3://b/p/x``)."""
    return "/".join([base.rstrip("/"), *parts]) if is_uri(base) else os.path.join(base, *parts)


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    from pyarrow import fs as pafs

    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(src, dst)


def stage_prepared(data_dir: Path, storage: str) -> str:
    """Put the prepared data in ``data_dir`` on the run storage (once per data version); returns its location.

    The manifest is written last, so a torn staging is seen as missing (and staged again), never as complete.
    """
    manifest = json.loads((data_dir / MANIFEST).read_text())
    dest = join(storage, STAGED, data_digest(manifest))
    if read_json(dest, MANIFEST) == manifest:
        return dest
    names = (*PREPARED_FILES, MANIFEST)
    if not is_uri(dest):
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=Path(dest).parent))
        for name in names:
            _link_or_copy(data_dir / name, tmp / name)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        return dest
    fs, path = filesystem(dest)
    fs.create_dir(path, recursive=True)
    for name in names:  # manifest last
        _copy(lambda n=name: open(data_dir / n, "rb"), lambda n=name: fs.open_output_stream(f"{path}/{n}"))
    return dest


def _copy(open_src: Callable[[], IO[bytes]], open_dst: Callable[[], IO[bytes]]) -> None:
    with open_src() as src, open_dst() as out:
        shutil.copyfileobj(src, out, 1 << 20)


def read_json(location: str, name: str) -> Any:
    """``<location>/<name>`` (a local path or a URI) parsed as JSON, or None if missing or unreadable."""
    try:
        fs, path = filesystem(location)
        with fs.open_input_stream(f"{path}/{name}") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def fetch_prepared(location: str, expected: Mapping[str, object], mmap: bool = False, where: str = "") -> Dataset:
    """Load the staged prepared data on a worker, checking it is the copy the driver saw.

    ``expected``: the driver's manifest; ``mmap``: map the inputs instead of reading them
    (:func:`pipeline.data.prepared.load_prepared`; a remote copy is downloaded to this node's disk first).
    Raises :class:`DatasetError` naming this node (``where``, default its host) and the path when the copy is
    missing, is another version, or a file's sha256 disagrees (a torn or modified copy).
    """
    where = where or f"host {socket.gethostname()}"
    fix = ("ray.storage_path must be storage that every node sees at the same path (an NFS/EFS mount) or a URI "
           "such as s3://bucket/prefix; the driver stages the prepared data there")
    seen = read_json(location, MANIFEST)
    if seen is None:
        raise DatasetError(f"{where} cannot see the prepared data at {location} (no {MANIFEST} there); {fix}")
    if seen.get("files") != expected.get("files"):
        raise DatasetError(f"{where} sees another version of the prepared data at {location} (its file digests "
                           f"differ from those the driver staged); rerun the stage, and check that {fix}")
    local = Path(location)
    if is_uri(location):
        local = _download(location, data_digest(expected))
    try:
        return load_prepared(local, verify=True, mmap=mmap)
    except DatasetError as exc:
        raise DatasetError(f"{where}: {exc}") from exc


def _download(location: str, digest: str) -> Path:
    cache = Path(os.environ.get(CACHE_ENV) or tempfile.gettempdir(), "transfusion-data", digest)
    if (cache / MANIFEST).is_file():
        return cache  # load_prepared(verify=True) still checks every file
    fs, path = filesystem(location)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.parent / f".{digest}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    for name in (*PREPARED_FILES, MANIFEST):
        _copy(lambda n=name: fs.open_input_stream(f"{path}/{n}"), lambda n=name: open(tmp / n, "wb"))
    try:
        os.replace(tmp, cache)
    except OSError:  # another worker on this node won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


# ------------------------------------------------------------------------------------------------- run status
def write_json(run_dir: str, name: str, data: object) -> None:
    """``<run_dir>/<name>`` (a local path or a URI) as JSON: what a worker leaves for the driver in its Ray run
    directory, :data:`STATUS_FILE` (e.g. ``{"error": "non_finite", "message": ..., "epoch": 3}``) and
    :data:`PLACEMENT_FILE` (where each rank trains, written when training starts: the checkpoints hold it too, but a
    trial that ASHA stops while its newest checkpoint uploads can be left with none that does)."""
    fs, path = filesystem(run_dir)
    fs.create_dir(path, recursive=True)
    with fs.open_output_stream(f"{path}/{name}") as f:
        f.write(json.dumps(data).encode())


def clear_status(run_dir: str) -> None:
    try:
        fs, path = filesystem(run_dir)
        fs.delete_file(f"{path}/{STATUS_FILE}")
    except (OSError, ValueError):
        pass
