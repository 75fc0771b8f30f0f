"""The tracking store fails fast and in one paragraph when it cannot be used."""

from __future__ import annotations

import sqlite3

import pytest

from pipeline.tracking import TrackingError, check_reachable, experiment_id


def test_missing_or_empty_store_is_fine(tmp_path):
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "empty.db").write_bytes(b"")
    check_reachable(f"sqlite:///{tmp_path / 'empty.db'}")


def test_a_garbage_file_is_named_with_the_fix(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a database at all\n" * 100)
    with pytest.raises(TrackingError) as err:
        check_reachable(f"sqlite:///{db}")
    text = str(err.value)
    assert "is not an SQLite database" in text and str(db) in text and "MLFLOW_TRACKING_URI" in text
    assert "\n" not in text


def test_a_damaged_sqlite_file_is_refused(tmp_path):
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table t (x integer)")
    con.executemany("insert into t values (?)", [(i,) for i in range(5000)])
    con.commit()
    con.close()
    blob = bytearray(db.read_bytes())
    blob[4096:8192] = b"\xff" * 4096  # a page of the table overwritten
    db.write_bytes(bytes(blob))
    with pytest.raises(TrackingError, match="damaged SQLite database"):
        check_reachable(f"sqlite:///{db}")


@pytest.mark.slow
def test_a_sqlite_store_of_another_program_is_one_paragraph(tmp_path):
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("create table experiments (x integer)")  # an MLflow table name, the wrong schema
    con.commit()
    con.close()
    check_reachable(f"sqlite:///{db}")  # a healthy SQLite file...
    with pytest.raises(TrackingError, match="cannot be used") as err:
        experiment_id(f"sqlite:///{db}", tmp_path)  # ...that MLflow cannot use
    assert "\n" not in str(err.value) and len(str(err.value)) < 1000
