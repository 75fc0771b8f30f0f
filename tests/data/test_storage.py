"""The run storage every node shares: staged prepared data (checked by each worker), and run status."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipeline.data.prepared import MANIFEST, PREPARED_FILES
from pipeline.data.storage import (
    CACHE_ENV,
    STAGED,
    STATUS_FILE,
    clear_status,
    data_digest,
    fetch_prepared,
    read_json,
    stage_prepared,
    write_json,
)
from pipeline.data.types import DatasetError
from tests.data.test_datasets import mapped_file


@pytest.fixture
def staged_input(prepared):  # tests/conftest.py's project: its data/prepared and their manifest
    return prepared / "data" / "prepared", read_json(str(prepared / "data" / "prepared"), MANIFEST)


def test_staging_is_content_addressed_linked_and_idempotent(tmp_path, staged_input):
    data_dir, manifest = staged_input
    storage = str(tmp_path / "shared")
    where = stage_prepared(data_dir, storage)
    assert where == os.path.join(storage, STAGED, data_digest(manifest))
    assert read_json(where, MANIFEST) == manifest
    # same file system: a hard link, not a second copy
    for name in PREPARED_FILES:
        assert os.stat(os.path.join(where, name)).st_ino == os.stat(data_dir / name).st_ino
    assert stage_prepared(data_dir, storage) == where  # once per data version
    ds = fetch_prepared(where, manifest)
    assert len(ds.train.y) == manifest["n_train"] and len(ds.test.y) == manifest["n_test"]
    mapped = fetch_prepared(where, manifest, mmap=True)  # a worker beyond its data budget maps the staged files
    assert torch.equal(mapped.train.x, ds.train.x) and torch.equal(mapped.test.y, ds.test.y)
    assert mapped_file(mapped.train.x) == os.path.realpath(os.path.join(where, "train_x.npy"))


def test_a_worker_that_cannot_see_the_storage_names_its_node_and_the_path(tmp_path, staged_input):
    _, manifest = staged_input
    missing = str(tmp_path / "elsewhere" / STAGED / data_digest(manifest))
    where = r"(host|node) .* cannot see the prepared data at .*elsewhere.*ray.storage_path"
    with pytest.raises(DatasetError, match=where):
        fetch_prepared(missing, manifest)


def test_another_version_or_a_modified_copy_is_refused(tmp_path, staged_input):
    data_dir, manifest = staged_input
    where = stage_prepared(data_dir, str(tmp_path / "shared"))
    other = json.loads(json.dumps(manifest))
    other["files"]["train_x.npy"]["sha256"] = "0" * 64
    with pytest.raises(DatasetError, match="another version of the prepared data"):
        fetch_prepared(where, other)
    target = os.path.join(where, "test_x.npy")
    os.unlink(target)  # break the link first: the project's copy stays intact
    blob = bytearray((data_dir / "test_x.npy").read_bytes())
    blob[-10] ^= 0xFF
    with open(target, "wb") as f:
        f.write(blob)
    with pytest.raises(DatasetError, match=r"(host|node) .*does not match the sha256"):
        fetch_prepared(where, manifest)


def test_remote_storage_uri_is_staged_and_downloaded_once(tmp_path, staged_input, monkeypatch):
    data_dir, manifest = staged_input
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    storage = (tmp_path / "bucket").as_uri()  # file:// goes through pyarrow's URI file systems, as s3:// does
    where = stage_prepared(data_dir, storage)
    assert where.startswith("file://") and where.endswith(data_digest(manifest))
    ds = fetch_prepared(where, manifest)
    assert len(ds.train.y) == manifest["n_train"]
    cached = tmp_path / "cache" / "transfusion-data" / data_digest(manifest)
    assert sorted(p.name for p in cached.iterdir()) == sorted(["manifest.json", *PREPARED_FILES])
    mapped = fetch_prepared(where, manifest, mmap=True)  # mapped from this node's copy
    assert torch.equal(mapped.train.x, ds.train.x)
    assert mapped_file(mapped.train.x) == os.path.realpath(cached / "train_x.npy")


@pytest.mark.parametrize("uri", [False, True])
def test_status_round_trip(tmp_path, uri):
    run_dir = (tmp_path / "run").as_uri() if uri else str(tmp_path / "run")
    assert read_json(run_dir, STATUS_FILE) is None
    write_json(run_dir, STATUS_FILE, {"error": "non_finite", "message": "loss nan", "epoch": 3})
    assert read_json(run_dir, STATUS_FILE) == {"error": "non_finite", "message": "loss nan", "epoch": 3}
    clear_status(run_dir)
    assert read_json(run_dir, STATUS_FILE) is None
    clear_status(run_dir)  # nothing to clear: fine
