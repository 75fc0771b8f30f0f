"""pipeline.io's CSV and JSON helpers (the atomic writers are exercised through every stage's tests)."""

import csv
import json
import math

import numpy as np
import pytest

from pipeline.io import csv_text, json_safe, write_csv


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
