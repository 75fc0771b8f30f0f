"""docs/api.md runs as written: its ```python blocks are executed, the plain PyTorch loop in the quick loop, the Ray
Train program (the block that builds a ``TorchTrainer``) on the test Ray instance, the section on the pretrained
encoder in a project that ``transfusion pretrain`` has just written. Tracebacks name the page's lines."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


HEADING = re.compile(r"^## (.+)$", re.MULTILINE)


def python_blocks(text: str, section: str | None = None) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every ```python block; with ``section``, of those under the
    ``## <section>`` heading alone."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)
            if section is None or section_of(text, m.start()) == section]


def section_of(text: str, pos: int) -> str | None:
    """The ``## `` heading above ``pos`` (None: above every heading)."""
    headings = [h.group(1).strip() for h in HEADING.finditer(text, 0, pos)]
    return headings[-1] if headings else None


TEXT = PAGE.read_text(encoding="utf-8")
BLOCKS = python_blocks(TEXT)
RAY = [b for b in BLOCKS if "TorchTrainer(" in b[1]]
PRETRAINED = python_blocks(TEXT, "Using the pretrained encoder")  # it needs a pretrained project
PLAIN = [b for b in BLOCKS if b not in RAY and b not in PRETRAINED]


def run(blocks: list[tuple[int, str]], page: Path = PAGE) -> dict:
    """Execute the blocks in order in one namespace, as one script would (``__main__``: Ray pickles its functions by
    value); compiled with the page's line numbers."""
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace


@pytest.mark.slow
def test_the_plain_pytorch_loop_learns(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = run(PLAIN)
    losses = namespace["losses"]
    assert len(losses) >= 20 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < sum(losses[:10]), losses  # the JSD goes down
    assert all(0 <= v <= 2 * math.log(2) for v in losses)
    printed = capsys.readouterr().out
    assert "JSD loss" in printed and printed.count("kNN accuracy") == 3, printed
    assert list(tmp_path.iterdir()) == [], "the plain loop writes nothing"
    # the page's callback: a draw of its own per epoch, step and rank, the same again on a resumed run
    import torch

    from pipeline import Callback

    noise, rank1 = namespace["InputNoise"](sigma=0.5), SimpleNamespace(rank=1)
    assert isinstance(noise, Callback)
    x = torch.zeros(64, 1, 8, 8)
    a = noise.on_step_start(rank1, 2, 3, x)
    assert torch.equal(a, noise.on_step_start(rank1, 2, 3, x)) and 0.45 < float(a.std()) < 0.55
    assert not torch.equal(a, noise.on_step_start(rank1, 2, 4, x))
    assert not torch.equal(a, noise.on_step_start(SimpleNamespace(rank=0), 2, 3, x))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ray_train_program_runs_on_two_workers(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its storage path, ray_results/, resolves here
    namespace = run(RAY)
    metrics = namespace["result"].metrics
    assert math.isfinite(metrics["first_loss"]) and math.isfinite(metrics["loss"]), metrics
    assert 0 <= metrics["loss"] <= 2 * math.log(2)
    state = namespace["state"]
    assert any(k.startswith("head.blocks.1.") for k in state) and any(k.startswith("backbone.") for k in state)
    assert (tmp_path / "ray_results" / "head-on-my-backbone").is_dir()


def test_the_set_clustering_page_runs_as_written(capsys):
    """docs/sets.md's block: ABC's head, its BCE on batches of sets, and `cluster` with the eigengap."""
    page = ROOT / "docs" / "sets.md"
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert len(blocks) == 1
    namespace = run(blocks, page)
    labels, k = namespace["labels"], namespace["k"]
    assert labels.shape == (20,) and 1 <= k <= 19 and len(set(labels.tolist())) == k
    assert math.isfinite(namespace["loss"].item())
    assert "clusters" in capsys.readouterr().out


@pytest.mark.slow
def test_the_pretrained_encoder_loads_from_models_pretrain_and_from_mlflow(prepared, ray_session, monkeypatch,
                                                                          capsys):
    """The section's blocks, in the project's root after a real one-epoch ``transfusion pretrain`` (Ray Train, its
    outputs, its MLflow run and model), with the project's default store."""
    from tests.conftest import invoke

    assert len(PRETRAINED) == 2, "the section shows models/pretrain/, then MLflow"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the project's own store, sqlite:///mlflow.db in its root
    result = invoke("pretrain", "-S", "train.epochs=1", "-S", "train.batch_size=64", "-S", "train.knn_every=0")
    assert result.exit_code == 0, result.output
    config = json.loads((prepared / "models/pretrain/config.json").read_text())
    capsys.readouterr()

    namespace = run(PRETRAINED)
    printed = capsys.readouterr().out.splitlines()
    dim, depth = config["params"]["model"]["embed_dim"], config["params"]["model"]["depth"]
    assert printed[0] == f"backbone (256, {dim}), blocks {[(256, dim)] * depth}", printed
    images = namespace["images"]
    assert images.shape == (256, 1, 8, 8) and 0 <= images.min() < images.max() <= 1
    assert namespace["run_id"] == config["mlflow_run_id"]
    assert printed[1] == f"run {config['mlflow_run_id']}: TransFusion, the same embeddings as models/pretrain/: True"
