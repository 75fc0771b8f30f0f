"""A rehearsal changes sizes only: every key outside the whitelist (``rehearse.SIZE_KEYS``) keeps the shipped
value, overrides of control keys are refused naming the key, and the default sizes still pass through every control
(a periodic checkpoint, an epoch without kNN, ASHA's first rung)."""

from __future__ import annotations

import pytest
import yaml

from pipeline.config.base import flatten, read_params_file
from pipeline.config.params import validate_params
from pipeline.config.rehearse import GRID_KEYS, SIZE_KEYS, RehearsalError, get, plan, with_default_rows
from pipeline.host import usable_cpus
from tests.conftest import ROOT, invoke

SHIPPED = ["params.yaml", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "presets").glob("*.yaml"))]
SETS_FILES = [f for f in SHIPPED if set(read_params_file(ROOT / f)) == {"sets"}]  # the set-clustering study's files
FILES = [f for f in SHIPPED if f not in SETS_FILES]  # whole params files: the cluster jobs


def shipped(name: str):
    return validate_params(with_default_rows(read_params_file(ROOT / name)), source=name)


def test_every_shipped_file_is_rehearsed():
    assert "presets/cluster-sweep.yaml" in FILES and "presets/paper-tables.yaml" in FILES
    assert SETS_FILES == ["presets/set-clustering.yaml"]


@pytest.mark.parametrize("name", SETS_FILES)
def test_a_set_study_rehearses_its_one_job_shrunk_in_size_only(name):
    """3 steps, 3 test sets, 2 seeds, no Omniglot: every method, lr, kernel, weight and set size as shipped."""
    from pipeline.config.sets import SetsConfig

    ship = read_params_file(ROOT / name)["sets"]
    p = plan(ROOT / name, cpus=2)
    assert p.jobs == ("sets",)
    after = SetsConfig.model_validate(p.raw["sets"]).model_dump()
    changed = {k for k in ship if ship[k] != after[k]}
    assert changed and {f"sets.{k}" for k in changed} <= set(SIZE_KEYS), changed
    assert after["steps"] == 3 and after["methods"] == ship["methods"] and after["lr"] == ship["lr"]
    assert after["seeds"] == ship["seeds"][:2] and "omniglot" not in after["datasets"]
    with pytest.raises(RehearsalError, match="sets.lr is a control key"):
        plan(ROOT / name, ["sets.lr=0.1"])
    with pytest.raises(RehearsalError, match="sets.seeds"):
        plan(ROOT / name, ["sets.seeds=[7]"])  # a grid is only shortened


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("gpus", [0, 4])
def test_default_rehearsal_changes_only_size_keys(name, gpus):
    before = flatten(shipped(name))
    p = plan(ROOT / name, cpus=2, gpus=gpus)
    after = flatten(validate_params(p.raw, source="rehearsal"))
    changed = {k for k in before if before[k] != after[k]}
    assert changed, "a rehearsal that changes nothing would not fit a laptop"
    assert changed <= set(SIZE_KEYS), f"control keys changed: {sorted(changed - set(SIZE_KEYS))}"
    assert set(p.changed) <= set(SIZE_KEYS)
    if gpus:
        assert after["ray.backend"] == "gloo" and after["ray.use_gpu"] == before["ray.use_gpu"]
    else:
        assert after["ray.use_gpu"] is False
    for key in GRID_KEYS:  # a grid is only shortened
        old, new = get(with_default_rows(read_params_file(ROOT / name)), key) or [], get(p.raw, key) or []
        assert all(v in old for v in new) and (bool(new) or not old)


@pytest.mark.parametrize("name", FILES)
def test_default_rehearsal_passes_through_every_control(name):
    ship = shipped(name)
    p = validate_params(plan(ROOT / name, cpus=2).raw, source="rehearsal")
    assert p.ray.num_workers >= min(ship.ray.num_workers, 2)  # several workers stay several
    assert p.train.epochs >= 2
    if ship.train.checkpoint_every > 1:  # a periodic checkpoint inside the run
        assert p.train.epochs > ship.train.checkpoint_every
    if ship.train.knn_every != 1:  # and an epoch without the kNN check (what crashed the tables job)
        assert any(e % ship.train.knn_every for e in range(1, p.train.epochs + 1))
    if ship.sweep.asha:  # ASHA reaches its first rung
        assert p.sweep.epochs > ship.sweep.grace_period
    trial = p.sweep.cpus_per_worker * p.ray.num_workers + 0.25
    assert 2 * trial <= 2, "two sweep trials fit 2 CPUs"


@pytest.mark.slow
def test_every_key_outside_the_whitelist_is_refused():
    for key, value in flatten(shipped("presets/cluster-sweep.yaml")).items():
        if key not in SIZE_KEYS and not key.startswith(("tables.", "theory.")):
            with pytest.raises(RehearsalError, match=rf"{key} is a control key"):
                plan(ROOT / "presets/cluster-sweep.yaml", [f"{key}={value!r}"])


@pytest.mark.parametrize("override, message", [
    ("sweep.depth=[0, 2]", "sweep.depth: .* subset of the shipped values"),
    ("sweep.depth=[1, 0]", "in their order"),
    ("sweep.batch_size=[]", "non-empty subset"),
    ("ray.num_workers=1", "between 2 and 4 workers"),
    ("ray.num_workers=8", "between 2 and 4 workers"),
    ("train.epochs=1", "at least 2 epochs"),
    ("sweep.epochs=5", "more epochs than the grace period"),
    ("ray.use_gpu=true", "needs GPUs"),
    ("ray.backend=nccl", "ray.backend"),
    ("sweep.num_samples=2", r"from 1 to the shipped 1 \(seeds a grid point"),
    ("sweep.num_samples=0", r"from 1 to the shipped 1 \(seeds"),
])
def test_a_size_beyond_its_rule_is_refused(override, message):
    with pytest.raises(RehearsalError, match=message):
        plan(ROOT / "presets/cluster-sweep.yaml", [override])


def test_sizes_within_their_rules_are_applied():
    p = plan(ROOT / "presets/cluster-sweep.yaml", ["sweep.depth=[0, 9]", "ray.num_workers=4", "sweep.epochs=11",
                                                   "model.embed_dim=8", "sweep.cpus_per_worker=0.125"])
    assert (get(p.raw, "sweep.depth"), get(p.raw, "ray.num_workers"), get(p.raw, "sweep.epochs")) == ([0, 9], 4, 11)
    assert get(p.raw, "sweep.grace_period") == 10 and get(p.raw, "sweep.asha") is True  # as shipped


def test_a_grid_of_several_seeds_a_point_rehearses_one_unless_told():
    name = ROOT / "presets/fashion-mnist-figure5.yaml"
    assert get(read_params_file(name), "sweep.num_samples") == 2
    assert get(plan(name).raw, "sweep.num_samples") == 1
    assert get(plan(name, ["sweep.num_samples=2"]).raw, "sweep.num_samples") == 2


def test_trials_at_once_are_this_machines_unless_told():
    """The trials at once a cluster preset ships are its cluster's size (Ray cannot tell how far an autoscaler grows
    a cluster): a rehearsal runs as many as this machine's Ray holds, or as told."""
    assert get(read_params_file(ROOT / "presets/cluster-sweep.yaml"), "sweep.max_concurrent_trials") == 4
    p = plan(ROOT / "presets/cluster-sweep.yaml")
    assert get(p.raw, "sweep.max_concurrent_trials") is None and p.changed["sweep.max_concurrent_trials"] is None
    assert "tables.max_concurrent_trials" not in p.changed  # null as shipped: nothing to change
    p = plan(ROOT / "presets/cluster-sweep.yaml", ["sweep.max_concurrent_trials=1"])
    assert get(p.raw, "sweep.max_concurrent_trials") == 1
    p = plan(ROOT / "presets/paper-tables.yaml")
    assert get(p.raw, "tables.max_concurrent_trials") is None


def test_the_command_refuses_a_control_key_before_any_work(tmp_path, monkeypatch, ray_starts):
    monkeypatch.chdir(tmp_path)
    result = invoke("rehearse", "--params", str(ROOT / "presets/paper-tables.yaml"), "-S", "train.knn_every=1")
    assert result.exit_code == 2
    assert "train.knn_every is a control key: a rehearsal keeps it as the file ships it (10)" in result.output
    assert not ray_starts and not (tmp_path / ".rehearsal").exists()
    result = invoke("rehearse", "--params", str(ROOT / "params.yaml"), "--jobs", "prepare,deploy")
    assert result.exit_code == 2 and "--jobs: deploy is not a job of" in result.output


def test_resume_needs_the_same_rehearsal_in_its_directory(tmp_path, monkeypatch, ray_starts):
    """``--resume`` keeps --dir only for a rehearsal of the same params (file, sizes, declared GPUs): else exit 2
    before any work, the directory untouched."""
    monkeypatch.chdir(tmp_path)
    shipped, work = str(ROOT / "presets/cluster-sweep.yaml"), tmp_path / "work"
    result = invoke("rehearse", "--params", shipped, "--dir", str(work), "--resume")
    assert result.exit_code == 2 and f"--resume: {work} holds no rehearsal" in result.output
    assert not work.exists()
    work.mkdir()
    raw = plan(shipped, ["sweep.epochs=13"], cpus=usable_cpus(), gpus=4).raw
    (work / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (work / "keep").write_text("")
    for args in (["-S", "sweep.epochs=13"], ["--gpus", "4"]):  # no GPUs declared, or other sizes
        result = invoke("rehearse", "--params", shipped, *args, "--dir", str(work), "--resume")
        assert result.exit_code == 2 and "--resume: the rehearsal in" in result.output, (args, result.output)
    assert not ray_starts and sorted(p.name for p in work.iterdir()) == ["keep", "params.yaml"]
