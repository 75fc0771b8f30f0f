"""The tables job without a cluster: row validation, resolution, layout of TABLES.md, the CSV's n/a cells, and what
it shares with the sweep (failure reasons), the threads a control probes on."""

from __future__ import annotations

import pytest

from pipeline.config.base import ParamsError
from pipeline.config.params import load_params
from pipeline.evaluation.tables_rows import resolve_rows
from pipeline.runs.job import TrialFailed, error_reason
from tests.conftest import ROOT

PRESET = ROOT / "presets/paper-tables.yaml"


def params(*overrides: str, path=ROOT / "params.yaml"):
    return load_params(path, overrides)


def test_the_preset_and_the_default_are_the_papers_eight_rows():
    preset = params(path=PRESET)
    rows = resolve_rows(preset)
    assert [(r.table, r.name) for r in rows] == [
        (1, "InfoNCE"), (1, "DCL"), (1, "BarlowTwins"), (1, "TransFusion 1-Layer"), (1, "TransFusion 9-Layer"),
        (2, "SupCon"), (2, "TransFusion 1-Layer"), (2, "TransFusion 9-Layer")]
    assert all(r.paper == r.name for r in rows)  # each beside the paper's row of its name
    by = {(r.table, r.name): r.params for r in rows}
    assert (by[1, "DCL"].loss.name, by[1, "DCL"].model.depth) == ("dcl", 0)
    assert (by[1, "TransFusion 9-Layer"].model.depth, by[1, "TransFusion 9-Layer"].augment.strength) == (9, 1.0)
    assert (by[2, "SupCon"].train.mode, by[2, "SupCon"].augment.strength) == ("supervised", 0.0)
    assert (preset.model.backbone, preset.data.dataset, preset.train.epochs, preset.train.batch_size) == (
        "resnet18_cifar", "cifar10", 200, 128)
    assert preset.probe.max_train is None  # the paper's 100 % of the labels
    assert params().tables.rows == preset.tables.rows  # params.yaml needs no tables section
    assert "tables" not in params().model_dump()  # nor does any other stage record it


@pytest.mark.parametrize(("override", "needles"), [
    ("tables.rows=[{name: A, table: 3}]", ["tables.rows.0.table", "1 or 2"]),
    ("tables.rows=[{name: A, table: 1, params: {loss.nme: jsd}}]",
     ["tables.rows[0] ('A')", "'loss.nme'", "name, temperature"]),
    ("tables.rows=[{name: A, table: 1, params: {data.dataset: cifar10}}]",
     ["'data.dataset'", "overrides only model.*"]),
    ("tables.rows=[{name: A, table: 1, colour: red}]", ["tables.rows.0.colour", "unknown key"]),
    ("tables.rows=[{table: 1}]", ["tables.rows.0.name"]),
    ("tables.seeds=[0, 0]", ["tables.seeds: [0, 0] repeats a seed"]),
    ("tables.seeds=[]", ["tables.seeds"]),
    ("tables.seeds=[-1]", ["tables.seeds.0"]),
    ("tables.controls=[pixels]", ["'raw_pixels' or 'random_init'"]),
    ("tables.controls=[raw_pixels, raw_pixels]", ["repeats a control; allowed: raw_pixels, random_init"]),
])
def test_bad_rows_seeds_and_controls_name_the_key(override, needles):
    with pytest.raises(ParamsError) as info:
        params(override)
    for needle in needles:
        assert needle in str(info.value)


def test_duplicate_rows_in_one_table_are_refused_but_a_name_may_repeat_across_tables():
    with pytest.raises(ParamsError, match=r"a second row named 'A' in table 1"):
        params("tables.rows=[{name: A, table: 1}, {name: A, table: 1}]")
    assert len(params("tables.rows=[{name: A, table: 1}, {name: A, table: 2}]").tables.rows) == 2


@pytest.mark.parametrize(("row", "needle"), [
    # resolved on the file's base: the loss needs the other mode, the mode is not the table's, the paper has no such row
    ("{name: A, table: 2, params: {train.mode: supervised, loss.name: infonce}}", "loss.name: infonce needs"),
    ("{name: A, table: 2, params: {loss.name: supcon}}", "train.mode is self_supervised, but table 2 is supervised"),
    ("{name: A, table: 1, paper: SimCLR}", "paper: 'SimCLR' is not a row of the paper's table 1"),
    ("{name: A, table: 1, params: {model.depth: -1}}", "model.depth"),
])
def test_rows_are_resolved_against_the_base_before_any_work(row, needle):
    p = params(f"tables.rows=[{row}]")
    with pytest.raises(ParamsError) as info:
        resolve_rows(p)
    assert "tables.rows[0] ('A'" in str(info.value) and needle in str(info.value)


def test_rows_may_train_abc_with_its_nested_keys_in_both_tables():
    abc = "model.method: abc, model.qk_init: default, loss.name: bce"
    p = params(f"tables.rows=[{{name: ABC, table: 1, params: {{{abc}, model.abc.compatibility: additive}}}}, "
               f"{{name: ABC, table: 2, params: {{{abc}, train.mode: supervised, model.abc.blocks: 0, "
               "loss.pos_weight: 3}}]")
    one, two = (r.params for r in resolve_rows(p))
    assert (one.model.method, one.model.abc.compatibility, one.model.abc.blocks, one.train.mode) == (
        "abc", "additive", 2, "self_supervised")
    assert (two.model.abc.blocks, two.loss.pos_weight, two.train.mode) == (0, 3.0, "supervised")
    with pytest.raises(ParamsError, match=r"'model.abc.nope': unknown key; allowed keys in model.abc: blocks"):
        params("tables.rows=[{name: A, table: 1, params: {model.abc.nope: 1}}]")
    with pytest.raises(ParamsError, match=r"(?s)tables.rows\[0\] \('A'.*model.qk_init: identity: TransFusion"):
        resolve_rows(params("tables.rows=[{name: A, table: 1, params: {model.method: abc, loss.name: bce}}]"))


def test_a_batch_beyond_the_data_is_refused():
    p = params("tables.rows=[{name: A, table: 1, params: {train.batch_size: 512}}]")
    with pytest.raises(ParamsError, match=r"train.batch_size 512 exceeds the training set \(300 samples\)"):
        resolve_rows(p, n_train=300)


def test_error_reason_is_one_line_also_through_rays_wrapper():
    from ray.exceptions import RayTaskError

    failed = TrialFailed("non_finite: non-finite loss (nan) (last good epoch 1)")
    wrapped = RayTaskError("_trial", "Traceback (most recent call last):\n  ...\nTrialFailed: ...", failed)
    assert error_reason(wrapped.as_instanceof_cause()) == str(failed)
    assert error_reason(failed) == str(failed)
    assert error_reason(None) == ""
    other = RayTaskError("_trial", "Traceback ...", RuntimeError("worker died\nmore detail"))
    assert error_reason(other) == "RuntimeError: worker died"


def test_every_row_runs_once_per_seed_beside_the_controls():
    from pipeline.evaluation.tables_rows import trial_configs

    p = params("tables.rows=[{name: InfoNCE, table: 1}, {name: SupCon, table: 2, params: {train.mode: supervised, "
               "loss.name: supcon}}]", "tables.seeds=[3, 5]")
    configs = trial_configs(p, resolve_rows(p))
    assert [(c["name"], c["table"], c["seed"], c["control"]) for c in configs] == [
        ("raw pixels", 0, 3, "raw_pixels"),  # once: the pixels have no seed
        ("random init", 0, 3, "random_init"), ("random init", 0, 5, "random_init"),
        ("InfoNCE", 1, 3, None), ("InfoNCE", 1, 5, None), ("SupCon", 2, 3, None), ("SupCon", 2, 5, None)]
    assert configs[-1]["params"] == {"train.mode": "supervised", "loss.name": "supcon"}
    # no seeds: the file's train.seed; no controls
    alone = params("tables.rows=[{name: InfoNCE, table: 1}]", "tables.controls=[]", "train.seed=7")
    assert [(c["name"], c["seed"]) for c in trial_configs(alone, resolve_rows(alone))] == [("InfoNCE", 7)]


@pytest.mark.slow
def test_a_controls_probes_run_on_the_threads_of_its_cpus_not_rays_one(prepared, ray_session):
    """A Ray process of 1.75 CPUs starts with OMP_NUM_THREADS=1 (Ray's whole part); a control's trial trains nothing
    that would set its threads, so its probes set them: 2, as a row's training does (torch_threads)."""
    import json

    import torch

    from pipeline.runs.tables import probe_row

    p = params("ray.cpus_per_worker=1.75", "probe.probes=[knn200]")
    manifest = json.loads((prepared / "data/prepared/manifest.json").read_text())

    @ray_session.remote(num_cpus=1)
    def control() -> tuple[int, int]:
        before = torch.get_num_threads()
        probe_row(p, str(prepared / "data/prepared"), manifest, None, control="random_init")
        return before, torch.get_num_threads()

    assert ray_session.get(control.remote()) == (1, 2)


# ------------------------------------------------------------------------------------------------ the tuning phase
SEARCHED = ("tables.rows=[{name: InfoNCE, table: 1, params: {loss.name: infonce}, "
            "space: {loss.temperature: [0.05, 0.1, 0.2], train.lr: [0.001, 0.01]}}, "
            "{name: JSD, table: 1, params: {loss.name: jsd}, space: {loss.power: [1.0, 16.0]}}, "
            "{name: DCL, table: 1, params: {loss.name: dcl}}]")


@pytest.mark.parametrize(("trials", "expected"), [(6, 6), (4, 4), (2, 2)])
def test_space_points_are_the_grid_or_a_seeded_sample_kept_in_grid_order(trials, expected):
    import itertools

    from pipeline.evaluation.tables_rows import space_points

    space = {"loss.temperature": [0.05, 0.1, 0.2], "train.lr": [0.001, 0.01]}
    grid = [{"loss.temperature": t, "train.lr": lr} for t, lr in itertools.product(*space.values())]
    points = space_points(space, trials, seed=0)
    assert len(points) == expected and len({str(p) for p in points}) == expected
    assert points == sorted(points, key=grid.index)  # grid order, whatever the draw
    assert points == space_points(space, trials, seed=0)  # seeded: the same points every time
    if trials < len(grid):
        assert any(space_points(space, trials, seed=s) != points for s in range(1, 20))
    else:
        assert points == grid


def test_every_searched_row_gets_the_same_budget_and_the_untuned_row_none():
    from pipeline.evaluation.tables_rows import tuning_rows, with_choices

    p = params(SEARCHED, "tables.tuning={trials: 2, epochs: 3, seed: 5}", "train.epochs=7")
    tuned = tuning_rows(p, resolve_rows(p))
    assert [(t.of, len(t.point)) for t in tuned] == [(0, 2), (0, 2), (1, 1), (1, 1)]  # DCL (index 2) has no space
    assert {t.row.params.train.epochs for t in tuned} == {3}  # the budget's epochs, not the file's 7
    assert tuned[2].point == {"loss.power": 1.0} and tuned[2].row.params.loss.power == 1.0
    assert {t.config(5)["phase"] for t in tuned} == {"tuning"} and tuned[0].config(5)["seed"] == 5
    for t in tuned[:2]:  # each point of InfoNCE's space in its row's params
        assert t.row.params.loss.temperature == t.point["loss.temperature"]
        assert t.row.params.train.lr == t.point["train.lr"]
    final = with_choices(p, {0: {"loss.temperature": 0.2, "train.lr": 0.01}, 1: {"loss.power": 16.0}})
    rows = resolve_rows(final)
    assert (rows[0].params.loss.temperature, rows[0].params.train.lr, rows[1].params.loss.power) == (0.2, 0.01, 16.0)
    assert rows[0].params.train.epochs == 7 and rows[2].params.loss.name == "dcl"  # the final rows: the file's epochs
    plain = params("tables.rows=[{name: A, table: 1}]")
    assert tuning_rows(plain, resolve_rows(plain)) == []  # nothing searched: no tuning phase


@pytest.mark.parametrize(("overrides", "needle"), [
    ((SEARCHED,), "the row has a space, but the job has no tuning budget; set tables.tuning"),
    ((SEARCHED, "tables.tuning={trials: 3}"), "its space holds 2 point(s), fewer than tables.tuning.trials (3)"),
    (("tables.rows=[{name: A, table: 1, space: {train.epochs: [1, 2]}}]", "tables.tuning={trials: 2}"),
     "space key 'train.epochs': the tuning budget sets it"),
    (("tables.rows=[{name: A, table: 1, space: {loss.power: [1.0, 1.0]}}]", "tables.tuning={trials: 1}"),
     "must list each value to try once"),
    (("tables.rows=[{name: A, table: 1, space: {data.seed: [1, 2]}}]", "tables.tuning={trials: 1}"),
     "space key 'data.seed': a row overrides only model.*"),
    (("tables.rows=[{name: A, table: 1, space: {loss.tau: [1, 2]}}]", "tables.tuning={trials: 1}"),
     "space key 'loss.tau': unknown key; allowed keys in loss: name, temperature"),
    (("tables.tuning={trials: 0}",), "tables.tuning.trials"),
])
def test_a_space_the_budget_cannot_search_is_refused_naming_the_key(overrides, needle):
    with pytest.raises(ParamsError) as info:
        params(*overrides)
    assert needle in str(info.value)


def test_a_point_its_table_refuses_is_named_before_any_work():
    from pipeline.evaluation.tables_rows import tuning_rows

    p = params("tables.rows=[{name: A, table: 1, space: {train.batch_size: [64, 512]}}]", "tables.tuning={trials: 2}")
    with pytest.raises(ParamsError, match=r"A · tuning 2.*train.batch_size 512 exceeds the training set"):
        tuning_rows(p, resolve_rows(p, n_train=300), n_train=300)


def test_the_report_gives_each_rows_choice_its_edge_and_the_untuned_rows():
    import json

    from pipeline.evaluation.tuning_report import at_edge, chosen_points, tuning_section

    p = params(SEARCHED, "tables.tuning={trials: 2, epochs: 2, seed: 1}")
    records = [{"of": 0, "name": "InfoNCE", "point": json.dumps({"loss.temperature": t, "train.lr": lr}),
                "knn_acc": acc} for t, lr, acc in [(0.1, 0.001, 0.74), (0.1, 0.01, 0.74)]]
    records += [{"of": 1, "name": "JSD", "point": json.dumps({"loss.power": w}), "knn_acc": acc}
                for w, acc in [(1.0, 0.6), (16.0, 0.8)]]
    best = chosen_points(records)
    assert json.loads(best[0]["point"]) == {"loss.temperature": 0.1, "train.lr": 0.001}  # a tie: the first
    assert chosen_points([{"of": 0, "knn_acc": None}]) == {}  # no trial scored: no choice
    assert json.loads(best[1]["point"]) == {"loss.power": 16.0}
    assert at_edge([1.0, 16.0], 16.0) and not at_edge([0.05, 0.1, 0.2], 0.1) and not at_edge(["a", "b"], "a")
    text = "\n".join(tuning_section(records, p))
    assert "2 trial(s) of 2 epoch(s), train.seed 1" in text
    assert "| InfoNCE | 1 | `loss.temperature` | 0.05, 0.1, 0.2 | 0.1 | 0.7400 | 2 |  |" in text
    assert "| InfoNCE | 1 | `train.lr` | 0.001, 0.01 | 0.001 | 0.7400 | 2 | at the edge of its grid" in text
    assert "| JSD | 1 | `loss.power` | 1, 16 | 16 | 0.8000 | 2 | at the edge of its grid" in text
    assert "Untuned (run as written, no space): DCL (table 1)." in text
    assert tuning_section([], params()) == []  # no searched row: no section
