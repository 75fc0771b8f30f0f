"""Each section module validates its own section alone (``load_section``), with the messages of the whole file."""

from __future__ import annotations

import pytest

from pipeline.config import data, ray, sweep, tables, theory
from pipeline.config.base import ParamsError, load_section
from pipeline.config.params import Params, load_params
from tests.conftest import ROOT

SECTIONS = {"data": data.DataConfig, "ray": ray.RayConfig, "sweep": sweep.SweepConfig, "theory": theory.TheoryConfig}


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_a_section_alone_is_the_whole_files_section(name):
    alone = load_section(ROOT / "params.yaml", name, SECTIONS[name])
    assert type(alone) is SECTIONS[name] and Params.model_fields[name].annotation is SECTIONS[name]
    assert alone == getattr(load_params(ROOT / "params.yaml"), name)


@pytest.mark.parametrize("name,override,needles", [
    ("ray", "ray.backend=mpi", ("ray.backend", "gloo")),
    ("sweep", "sweep.batch_size=[1]", ("sweep.batch_size.0", "greater than or equal to 2")),
    ("data", "data.extra=1", ("data.extra", "unknown key", "test_fraction")),
])
def test_a_bad_value_names_its_key(name, override, needles):
    with pytest.raises(ParamsError) as err:
        load_section(ROOT / "params.yaml", name, SECTIONS[name], [override])
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_other_sections_are_not_read_but_every_override_must_be_well_formed(tmp_path):
    text = (ROOT / "params.yaml").read_text().replace("  depth: 1 ", "  depth: lots ", 1)
    (tmp_path / "p.yaml").write_text(text)
    assert load_section(tmp_path / "p.yaml", "data", data.DataConfig).dataset == "digits"
    with pytest.raises(ParamsError, match="model.depth"):
        load_params(tmp_path / "p.yaml")
    (tmp_path / "q.yaml").write_text("model: {}\n")
    with pytest.raises(ParamsError, match="data: required section is missing"):
        load_section(tmp_path / "q.yaml", "data", data.DataConfig)


@pytest.mark.parametrize("reference", ["InfoNCE", "SupCon", "raw_pixels", "raw pixels"])
def test_tables_reference_is_a_row_or_a_control_of_the_job(reference):
    rows = "tables.rows=[{name: InfoNCE, table: 1}, {name: SupCon, table: 2, params: {train.mode: supervised}}]"
    p = load_params(ROOT / "params.yaml", [rows, "tables.controls=[raw_pixels]", f"tables.reference={reference}"])
    assert p.tables.reference == reference
    assert load_params(ROOT / "params.yaml", [rows]).tables.reference is None  # none: no comparison


@pytest.mark.parametrize("reference", ["SimCLR", "random_init"])  # not a row; a control the job does not run
def test_an_unknown_tables_reference_is_refused_naming_the_key_and_the_allowed_names(reference):
    rows = "tables.rows=[{name: InfoNCE, table: 1}, {name: SupCon, table: 2}]"
    with pytest.raises(ParamsError) as err:
        load_params(ROOT / "params.yaml", [rows, "tables.controls=[raw_pixels]", f"tables.reference={reference}"])
    assert f"tables.reference: {reference!r} is not a row of this job; allowed: 'InfoNCE', 'SupCon', 'raw_pixels'" \
        in str(err.value)


def test_tables_rows_override_only_the_row_sections():
    assert tables.ROW_SECTIONS == ("model", "loss", "augment", "train")
    assert [r.name for r in tables.TablesConfig().rows][:2] == ["InfoNCE", "DCL"]
    with pytest.raises(ValueError, match="a row overrides only"):
        tables.TablesConfig(rows=[tables.TableRow(name="x", table=1, params={"data.seed": 1})])
