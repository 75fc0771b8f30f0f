"""The sweep's search space, trial params, concurrency, naming and output tables (no Ray cluster needed)."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from pipeline.config.base import ParamsError
from pipeline.config.params import load_params
from pipeline.config.ray import TRIAL_CPU
from pipeline.config.resources import TrialShape, max_concurrent, trials_at_once
from pipeline.config.space import axes, base_params, check_points, grid_points, point_params, trial_params
from pipeline.runs.job import job_name
from pipeline.runs.sweep import trial_rows
from pipeline.runs.tune import inline, outcomes, trial_placement
from stages.sweep import best_trial, columns, write_outputs
from tests.conftest import ROOT

MANIFEST = {"files": {"train.pt": {"sha256": "a"}, "test.pt": {"sha256": "b"}}}


def params(*overrides: str):
    return load_params(ROOT / "params.yaml", overrides)


@pytest.mark.parametrize(("overrides", "expected"), [
    ((), 8), (("sweep.depth=[0,1,3]",), 12), (("sweep.lr=[0.001,0.01]",), 16),
    (("sweep.lr=[0.001,0.01]", "sweep.loss=[jsd,kl_relu,kl_squared]"), 48),
    (("sweep.num_samples=3",), 24),  # grid: three seeds per point
    (("sweep.search=random", "sweep.num_samples=3"), 8),  # random: the listed values, sampled
])
def test_grid_points_is_the_cross_product(overrides, expected):
    p = params(*overrides)
    points = grid_points(p)
    assert len(points) == expected
    assert len({json.dumps(pt, sort_keys=True) for pt in points}) == expected  # no duplicates
    a = axes(p)
    for key, values in a.items():
        assert sorted({pt[key] for pt in points}) == sorted(values)


def test_grid_repeats_are_seeds_not_copies():
    p = params("sweep.num_samples=3", "train.seed=7")
    assert axes(p)["train.seed"] == [7, 8, 9]
    assert "train.seed" not in axes(params("sweep.search=random", "sweep.num_samples=3"))


def test_trial_params_apply_the_point_over_the_sweep_base():
    p = params("train.epochs=40", "train.knn_every=5", "train.warmup_epochs=10")
    base = base_params(p)
    t = trial_params(base, {"model.depth": 3, "train.batch_size": 64, "augment.strength": 0.5})
    assert (t.model.depth, t.train.batch_size, t.augment.strength) == (3, 64, 0.5)
    # the sweep's epochs, a kNN check every epoch (ASHA's metric), a checkpoint every epoch, warmup clipped
    assert (t.train.epochs, t.train.knn_every, t.train.checkpoint_every) == (6, 1, 1)
    assert t.train.warmup_epochs == 5 and t.ray.cpus_per_worker == 0.5
    assert t.model.backbone == p.model.backbone and t.loss == p.loss


def test_with_method_abc_the_depth_axis_sets_abcs_blocks():
    p = params("model.method=abc", "model.qk_init=default", "loss.name=bce", "sweep.depth=[0,3]")
    check_points(p)  # the TransFusion depth of the points would be refused with method abc; ABC's blocks are not
    t = point_params(base_params(p), {"model.depth": 3, "train.batch_size": 64})
    assert (t.model.method, t.model.abc.blocks, t.model.depth, t.train.batch_size) == ("abc", 3, 1, 64)
    assert point_params(base_params(params()), {"model.depth": 3}).model.depth == 3  # transfusion: as before
    # the base's blocks never reach a trial, so the sweep's name ignores them as it ignores model.depth
    same = params("model.method=abc", "model.qk_init=default", "loss.name=bce", "sweep.depth=[0,3]",
                  "model.abc.blocks=5")
    assert job_name("sweep", p, MANIFEST) == job_name("sweep", same, MANIFEST)


def test_an_invalid_point_names_the_point_and_the_key():
    p = params("ray.num_workers=2")
    with pytest.raises(ParamsError, match=r"(?s)sweep point \{'train.batch_size': 15\}.*multiple of ray.num_workers"):
        trial_params(base_params(p), {"train.batch_size": 15})


@pytest.mark.parametrize(("overrides", "totals", "gpu", "n_trials", "expected"), [
    ((), {"CPU": 2}, False, 8, 2),                             # 0.25 + 1 x 0.5 per trial, two fit 2 CPUs
    (("ray.num_workers=2",), {"CPU": 2}, False, 8, 1),         # 0.25 + 2 x 0.5
    (("ray.num_workers=2",), {"CPU": 64}, False, 100, 51),
    (("ray.num_workers=2",), {"CPU": 64}, False, 8, 8),        # never more than the trials there are
    ((), {"CPU": 0.5}, False, 8, 1),                           # never 0: the trial waits for room
    (("sweep.max_concurrent_trials=3",), {"CPU": 64}, False, 8, 3),
    # GPUs bound it, not CPUs: 2 workers of (0.5 CPU, 1 GPU) per trial on 64 CPUs and 4 GPUs
    (("ray.num_workers=2",), {"CPU": 64, "GPU": 4}, True, 100, 2),
    (("ray.num_workers=2",), {"CPU": 36, "GPU": 4}, True, 100, 2),  # 4 one-GPU nodes and a CPU node
])
def test_max_concurrent_by_the_clusters_limiting_resource(overrides, totals, gpu, n_trials, expected):
    p = params(*overrides)
    shape = TrialShape(p.ray.num_workers, p.sweep.cpus_per_worker, gpu, TRIAL_CPU)
    assert max_concurrent(p.sweep.max_concurrent_trials, shape, totals, n_trials) == expected


@pytest.mark.parametrize(("overrides", "gpu"), [((), False), ((), True), (("ray.num_workers=2",), False),
                                                (("ray.num_workers=4", "sweep.cpus_per_worker=3"), True)])
def test_a_trial_holds_the_bundles_max_concurrent_counts(overrides, gpu):
    """One worker trains inside the trial, in its worker's bundle (the GPU is the trial's own): Tune holds it pending
    until all of it fits. More need Ray Train, whose workers ask for their bundles themselves (and wait for them).
    Either way the trial's bundles plus its workers' are the shape ``max_concurrent`` counts."""
    p = params(*overrides)
    trial = trial_params(base_params(p), {})
    held = trial_placement(trial, gpu).bundles
    shape = TrialShape(p.ray.num_workers, p.sweep.cpus_per_worker, gpu, TRIAL_CPU)
    if inline(trial):
        assert p.ray.num_workers == 1 and held == shape.bundles()
        assert held[0] == {"CPU": p.sweep.cpus_per_worker, **({"GPU": 1.0} if gpu else {})}  # where the trial runs
    else:
        assert held == [{"CPU": TRIAL_CPU}] and shape.bundles()[-1] == {"CPU": TRIAL_CPU}
    totals = {"CPU": 2.0, "GPU": 4.0 if gpu else 0.0}
    assert max_concurrent(None, shape, totals, 8) == trials_at_once(totals, shape, 8)


def test_the_sweeps_name_ignores_swept_keys_and_follows_the_rest():
    name = job_name("sweep", params(), MANIFEST)
    assert name.startswith("sweep-") and name == job_name("sweep", params(), MANIFEST)
    assert job_name("sweep", params("model.depth=5", "train.batch_size=64", "train.epochs=3"), MANIFEST) == name
    assert job_name("sweep", params("train.lr=0.01"), MANIFEST) != name
    assert job_name("sweep", params("sweep.epochs=3"), MANIFEST) != name
    other = {"files": {"train.pt": {"sha256": "c"}, "test.pt": {"sha256": "b"}}}
    assert job_name("sweep", params(), other) != name


@pytest.mark.parametrize("bad", ["sweep.depth=[]", "sweep.batch_size=[1]", "sweep.strength=[1.5]", "sweep.search=bayes",
                                 "sweep.max_concurrent_trials=0", "sweep.epochs=0", "sweep.lr=[-1]"])
def test_bad_sweep_params_name_the_key(bad):
    with pytest.raises(ParamsError, match=bad.split("=")[0].replace(".", r"\.")):
        params(bad)


def rows_fixture():
    rows = []
    for k, (depth, batch, strength, acc, epochs, status) in enumerate([
        (0, 16, 0.0, 0.90, 4, "TERMINATED"), (0, 16, 1.0, 0.95, 4, "TERMINATED"),
        (1, 16, 0.0, 0.80, 2, "TERMINATED"), (1, 16, 1.0, math.nan, 0, "ERROR"),
    ]):
        history = [{"epoch": e, "loss": 1.0 / e, "knn_acc": acc, "view_noise": 0.1 * strength, "samples_per_s": 100.0}
                   for e in range(1, epochs + 1)]
        rows.append({"trial_id": f"t_{k:05d}", "model.depth": depth, "train.batch_size": batch,
                     "augment.strength": strength, "view_noise": 0.1 * strength, "knn_acc": acc, "best_knn_acc": acc,
                     "loss": 0.5, "epochs": epochs, "stopped_early": 0 < epochs < 4, "seconds": 1.0, "status": status,
                     "history": history})
    return rows


def test_best_trial_is_the_best_finished_one():
    rows = rows_fixture()
    assert best_trial(rows)["trial_id"] == "t_00001"
    assert best_trial([r for r in rows if r["status"] == "ERROR"]) is None
    tie = [dict(rows[0], trial_id="b"), dict(rows[0], trial_id="a")]
    assert best_trial(tie)["trial_id"] == "a"


def test_write_outputs_tables_plot_and_best(tmp_path):
    p = params("sweep.epochs=4")
    best = write_outputs(p, rows_fixture(), tmp_path / "sweeps", tmp_path / "plots" / "sweep", "digits")
    with open(tmp_path / "sweeps/results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["trial_id"] for r in table] == ["t_00000", "t_00001", "t_00002", "t_00003"]
    assert list(table[0]) == list(columns())
    assert table[0]["train.lr"] == str(p.train.lr) and table[3]["status"] == "ERROR"
    assert table[2]["stopped_early"] == "True" and table[2]["epochs"] == "2"
    saved = json.loads((tmp_path / "sweeps/best.json").read_text())
    assert saved["trial_id"] == best["trial_id"] == "t_00001" and saved["knn_acc"] == 0.95
    assert "history" not in saved
    plots = tmp_path / "plots" / "sweep"
    assert sorted(x.name for x in plots.iterdir()) == ["curves.csv", "lr.csv", "lr.png", "phase.csv", "phase.png"]
    with open(plots / "lr.csv") as f:  # one lr, one loss: one point, a line per depth × batch × strength
        assert {(r["train.lr"], r["n"]) for r in csv.DictReader(f)} == {(str(p.train.lr), "1"), (str(p.train.lr), "0")}
    assert (plots / "phase.png").read_bytes()[:4] == b"\x89PNG"
    with open(plots / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 4 + 4 + 2 and curves[0]["trial_id"] == "t_00000" and curves[-1]["epoch"] == "2"
    with open(plots / "phase.csv") as f:
        phase = list(csv.DictReader(f))
    assert len(phase) == 4 and phase[3]["knn_acc"] == "nan" and phase[1]["knn_acc"] == "0.95"


def test_params_yaml_default_sweep_is_small():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    p = params()
    assert len(grid_points(p)) <= 8 and p.sweep.epochs <= 10, "the default sweep must stay a few minutes on 2 cores"
    assert set(raw["sweep"]) == set(type(p.sweep).model_fields)


def test_cluster_preset_is_valid_and_is_the_documented_grid():
    p = load_params(ROOT / "presets/cluster-sweep.yaml")
    assert (p.data.dataset, p.model.backbone, p.ray.use_gpu) == ("cifar10", "resnet18_cifar", True)
    assert p.sweep.depth == [0, 1, 3, 5, 9] and min(p.sweep.batch_size) == 32 and max(p.sweep.batch_size) == 4096
    assert p.sweep.strength[0] == 0.0 and p.sweep.strength[-1] == 1.0 and p.sweep.asha
    assert len(grid_points(p)) == 240
    for point in grid_points(p):  # every point is a valid run (e.g. the batch splits over the workers)
        trial_params(base_params(p), point)


def tune_result(path, reported: list[dict]) -> SimpleNamespace:
    """What Tune's ResultGrid yields, as far as trial_rows reads it."""
    return SimpleNamespace(metrics_dataframe=pd.DataFrame(reported), path=str(path), config={}, error=None,
                           checkpoint=None)


def test_rows_carry_the_last_epochs_block_health():
    alive = {"block_1.positive": 0.4, "block_1.uniform_rows": 0.0, "block_2.positive": 0.2, "block_2.uniform_rows": 0.1}
    dead = {"block_1.positive": 0.3, "block_1.uniform_rows": 0.0, "block_2.positive": 0.0, "block_2.uniform_rows": 1.0}
    grid = [tune_result("/x/trial-a", [{"epoch": 1, "loss": 1.0, **dead}, {"epoch": 2, "loss": 0.9, **alive}]),
            tune_result("/x/trial-b", [{"epoch": 1, "loss": 1.0, **alive}, {"epoch": 2, "loss": 0.9, **dead}]),
            tune_result("/x/trial-c", [{"epoch": 1, "loss": 1.0}, {"epoch": 2, "loss": 0.9}])]  # depth 0: no blocks
    a, b, c = trial_rows(outcomes(grid), epochs=2)
    assert (a["min_positive"], a["max_uniform_rows"], a["dead_blocks"]) == (0.2, 0.1, 0)
    assert (b["min_positive"], b["max_uniform_rows"], b["dead_blocks"]) == (0.0, 1.0, 1)
    assert math.isnan(c["min_positive"]) and c["dead_blocks"] == 0
    assert "block_2.positive" in b["history"][-1]  # the curves keep the health too
    for col in ("min_positive", "max_uniform_rows", "dead_blocks"):
        assert col in columns()


def test_where_ranks_ran_comes_from_the_newest_checkpoint_that_has_it(tmp_path):
    """A multi-worker trial stopped by ASHA while its last checkpoint was still uploading: its record (where the ranks
    ran) is in the checkpoint before."""
    from pipeline.runs.train import RECORD_FILE

    ranks = [{"rank": 1, "gpu_ids": ["3"]}, {"rank": 0, "gpu_ids": ["2"]}]
    done, torn = tmp_path / "checkpoint_000008", tmp_path / "checkpoint_000009"
    done.mkdir()
    torn.mkdir()  # the upload never finished: nothing in it
    (done / RECORD_FILE).write_text(json.dumps({"epoch": 8, "history": [], "workers": ranks}))

    result = tune_result(tmp_path / "trial-x", [{"epoch": 9, "loss": 1.0, "checkpoint_path": str(done)},
                                                {"epoch": 10, "loss": 0.9, "checkpoint_path": str(torn)}])
    (row,) = trial_rows(outcomes([result]), epochs=20)
    assert (row["workers"], row["gpu_ids"], row["epochs"], row["stopped_early"]) == (2, "2 3", 10, True)


def test_where_ranks_ran_comes_from_the_run_directory_when_no_checkpoint_has_it(tmp_path):
    """Seen on a resumed two-worker trial that ASHA stopped: none of its reported checkpoints held a record. The
    placement rank 0 left in the trial's Ray Train run directory (``storage/trial-<id>``) gives the row its GPUs."""
    from pipeline.data.storage import PLACEMENT_FILE, write_json

    gone = tmp_path / "trial-y" / "checkpoint_000009"  # pruned, or torn: nothing readable there

    result = tune_result(tmp_path / "tune" / "trial-y", [{"epoch": 10, "loss": 0.9, "checkpoint_path": str(gone)}])
    (row,) = trial_rows(outcomes([result], str(tmp_path)), epochs=20)
    assert (row["workers"], row["gpu_ids"]) == (0, "")  # nothing to read: "" (not a made-up placement)
    placed = [{"rank": 1, "gpu_ids": ["1"]}, {"rank": 0, "gpu_ids": ["0"]}]
    write_json(str(tmp_path / "trial-y"), PLACEMENT_FILE, placed)
    (row,) = trial_rows(outcomes([result], str(tmp_path)), epochs=20)
    assert (row["workers"], row["gpu_ids"], row["epochs"]) == (2, "0 1", 10)


def test_a_resumed_trial_stopped_mid_upload_keeps_every_epoch(tmp_path):
    """A trial resumed at epoch 5 reports epochs 6-8 to Tune (a restored trial's table starts there), and ASHA stops
    it while epoch 8's checkpoint is still uploading: its curve still starts at epoch 1, from the newest complete
    checkpoint in the trial's run directory, followed by what Tune reported after it."""
    from pipeline.runs.train import RECORD_FILE

    run_dir = tmp_path / "trial-z"
    old, torn = run_dir / "checkpoint_2026-11-26_10-00-05.000000", run_dir / "checkpoint_2026-11-26_10-00-08.000000"
    old.mkdir(parents=True)
    torn.mkdir()  # the upload never finished
    history = [{"epoch": e, "loss": 2.0 - e / 10} for e in range(1, 6)]
    (old / RECORD_FILE).write_text(json.dumps({"epoch": 5, "history": history, "workers": []}))

    reported = [{"epoch": e, "loss": 1 - e / 100, "checkpoint_path": str(torn) if e == 8 else None} for e in (6, 7, 8)]
    result = tune_result(tmp_path / "tune" / "trial-z", reported)
    (row,) = trial_rows(outcomes([result], str(tmp_path)), epochs=20)
    assert [h["epoch"] for h in row["history"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row["history"][4]["loss"] == 1.5 and row["history"][-1]["loss"] == 0.92  # checkpoint, then Tune's table
    assert (row["epochs"], row["stopped_early"]) == (8, True)
    (row,) = trial_rows(outcomes([result]), epochs=20)  # no storage: Tune's table alone
    assert [h["epoch"] for h in row["history"]] == [6, 7, 8]


def test_the_trackers_record_lives_in_the_jobs_directory_so_a_restored_copy_continues_it(tmp_path):
    """Tune pickles the job's tracker into the job's directory and a restored job unpickles a copy of it: the record
    of the trials (statuses, when each trained) is in the job's directory, so the copy continues it and the driver
    reads what both wrote."""
    import ray.cloudpickle

    from pipeline.runs.sweep import SweepTracker
    from pipeline.runs.tune import Record

    class Trial:  # as far as the tracker reads Tune's Trial
        def __init__(self, trial_id, status):
            self.trial_id, self.status, self.config = trial_id, status, {}

    first = SweepTracker(3, str(tmp_path))
    first.setup(total_num_samples=3)
    first.on_step_end(1, [Trial("a", "RUNNING"), Trial("b", "PENDING")])
    first.on_trial_result(1, [], Trial("a", "RUNNING"), {"epoch": 1, "loss": 1.0})
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(first))
    assert copy is not first
    copy.on_step_end(2, [Trial("a", "TERMINATED"), Trial("b", "RUNNING")])
    copy.on_trial_result(2, [], Trial("b", "RUNNING"), {"epoch": 1, "loss": 1.0})
    record = Record.read(str(tmp_path))
    assert record.unfinished() == ["b", "(not started)"]  # a never started: total 3
    assert record.peak_at_once() == 2  # a and b both started, neither ended
