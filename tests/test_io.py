"""pipeline.io's CSV and JSON helpers, and its atomic writers' refusals of an output path that cannot be written (the
writers themselves are exercised through every stage's tests; tests/stages/test_blocked_outputs.py: the refusals'
way through a stage)."""

import csv
import json
import math
import os
import tempfile

import numpy as np
import pytest

from pipeline.io import OutputError, atomic_dir, atomic_path, csv_text, json_safe, write_csv, write_json


def test_csv_text_mappings_and_sequences():
    rows = [{"a": 1, "b": None, "extra": "left out"}, {"b": 2.5}]
    assert csv_text(rows, ["a", "b"]) == "a,b\n1,\n,2.5\n"
    assert csv_text([{"x": 1, "y": "p,q"}]) == 'x,y\n1,"p,q"\n'  # columns: the first row's keys
    assert csv_text([[0.5, None]], ["u", "v"], fmt=lambda v: f"{v:.3f}") == "u,v\n0.500,\n"
    with pytest.raises(ValueError, match="columns"):
        csv_text([])


def test_write_csv_round_trips(tmp_path):
    path = tmp_path / "sub" / "t.csv"
    write_csv(path, [{"k": "a", "v": 1}, {"k": "b", "v": 2}], ["k", "v"])
    with open(path, newline="") as f:
        assert list(csv.DictReader(f)) == [{"k": "a", "v": "1"}, {"k": "b", "v": "2"}]
    assert [p.name for p in path.parent.iterdir()] == ["t.csv"]


def test_json_safe_is_strict_json():
    obj = {"a": [math.inf, -math.inf, (np.float32(0.5), np.int64(3))], 2: {"n": math.nan, "b": np.bool_(True)}}
    safe = json_safe(obj)
    assert safe == {"a": ["inf", "-inf", [0.5, 3]], "2": {"n": "nan", "b": True}}
    json.dumps(safe, allow_nan=False)


def test_a_directory_in_a_files_place_is_refused_naming_the_path(tmp_path):
    blocked = tmp_path / "metrics" / "pretrain.json"
    (blocked / "inside").mkdir(parents=True)
    with pytest.raises(OutputError, match=f"^cannot write {blocked}: a directory of that name is in the way; "):
        write_json(blocked, {"a": 1})
    assert [p.name for p in blocked.parent.iterdir()] == ["pretrain.json"]  # no temporary sibling left
    assert [p.name for p in blocked.iterdir()] == ["inside"]  # untouched


def test_a_file_in_a_directorys_place_or_a_parents_is_refused(tmp_path):
    (tmp_path / "plots").write_text("a file")
    with pytest.raises(OutputError, match="a file of that name is in the way"), atomic_dir(tmp_path / "plots"):
        pytest.fail("the block must not run")
    with pytest.raises(OutputError, match=f"cannot write {tmp_path / 'plots' / 'x.csv'}: {tmp_path / 'plots'} is a "
                                          "file, not a directory"):
        write_csv(tmp_path / "plots" / "x.csv", [{"a": 1}])
    assert [p.name for p in tmp_path.iterdir()] == ["plots"] and (tmp_path / "plots").read_text() == "a file"


def test_a_directory_appearing_during_the_write_is_refused_and_the_temporary_file_removed(tmp_path):
    out = tmp_path / "out.json"
    with pytest.raises(OutputError, match=f"cannot write {out}: a directory of that name is in the way"):
        with atomic_path(out) as tmp:
            tmp.write_text("half")
            out.mkdir()  # os.replace then fails (IsADirectoryError)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and out.is_dir()


def test_a_failing_block_leaves_the_old_output_and_no_temporary_file(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("old")
    with pytest.raises(RuntimeError, match="crash"), atomic_path(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"] and out.read_text() == "old"


def test_no_permission_is_refused_naming_the_folder(tmp_path, monkeypatch):
    """What a read-only folder raises (PermissionError from mkstemp), simulated: root writes anywhere."""
    def denied(**kwargs):
        raise PermissionError(13, "Permission denied", kwargs["dir"])

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(OutputError, match=f"cannot write {tmp_path / 'a.json'}: no permission to write in {tmp_path}; "
                                          "make it writable"):
        write_json(tmp_path / "a.json", {})


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores a folder's permissions")
@pytest.mark.parametrize("writer", ["file", "directory"])
def test_a_read_only_folder_is_refused_and_left_as_it_was(tmp_path, writer):
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "out").mkdir() if writer == "directory" else (folder / "out").write_text("old")
    folder.chmod(0o555)
    try:
        with pytest.raises(OutputError, match=f"cannot write {folder / 'out'}: no permission to write in {folder}"):
            if writer == "directory":
                with atomic_dir(folder / "out") as d:
                    (d / "x").write_text("new")
            else:
                write_json(folder / "out", {"new": 1})
        assert [p.name for p in folder.iterdir()] == ["out"]
        assert (folder / "out").is_dir() if writer == "directory" else (folder / "out").read_text() == "old"
    finally:
        folder.chmod(0o755)
