"""docs/api.md runs as written: its ```python blocks are executed, the plain PyTorch loop in the quick loop, the Ray
Train program (the block that builds a ``TorchTrainer``) on the test Ray instance. Tracebacks name the page's lines."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every ```python block."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(PAGE.read_text(encoding="utf-8"))
RAY = [b for b in BLOCKS if "TorchTrainer(" in b[1]]
PLAIN = [b for b in BLOCKS if b not in RAY]


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
