"""pipeline.evaluation.ssl_report: the recorded self-supervised study's tables, against numbers computed here."""

from __future__ import annotations

import csv
import statistics

import pytest

from pipeline.evaluation.ssl_report import mean_sd, section, table

FIELDS = ("method", "seed", "knn200", "logreg", "epochs", "batch_size", "n_train", "device", "train_seconds")


def rows(spec: dict[str, list[tuple[float, float]]], epochs: int = 6) -> list[dict[str, str]]:
    out = []
    for method, values in spec.items():
        control = method in ("raw pixels", "random init")
        for seed, (knn, logreg) in enumerate(values):
            out.append({"method": method, "seed": str(seed), "knn200": str(knn), "logreg": str(logreg),
                        "epochs": "0" if control else str(epochs), "batch_size": "256", "n_train": "60000",
                        "device": "cpu", "train_seconds": "" if control else str(10.0 + seed)})
    return out


@pytest.mark.parametrize("values", [[0.5], [0.5, 0.7], [0.61, 0.64, 0.7]])
def test_mean_sd_is_the_mean_and_the_sample_sd(values):
    sd = 0.0 if len(values) == 1 else (sum((v - sum(values) / len(values)) ** 2 for v in values)
                                       / (len(values) - 1)) ** 0.5
    assert mean_sd(values) == f"{sum(values) / len(values):.3f} ± {sd:.3f}"
    assert mean_sd([]) == "n/a"


def test_table_has_the_controls_first_and_every_method_once():
    data = rows({"InfoNCE": [(0.75, 0.83), (0.76, 0.84)], "raw pixels": [(0.71, 0.79), (0.71, 0.80)],
                 "random init": [(0.65, 0.82), (0.66, 0.81)]})
    lines = table(data).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| raw pixels", "| random init", "| InfoNCE"]
    knn = statistics.mean([0.75, 0.76]), statistics.stdev([0.75, 0.76])
    assert lines[4] == f"| InfoNCE | {knn[0]:.3f} ± {knn[1]:.3f} | 0.835 ± 0.007 | 2 | 6 | 10 |"
    assert lines[2].endswith("| 2 | 0 | - |")  # controls train nothing


def test_section_one_table_per_recorded_folder(tmp_path):
    assert section(tmp_path) == ""
    for name, epochs in (("cpu-10k", 8), ("h200-6epochs", 6)):
        (tmp_path / name).mkdir()
        with (tmp_path / name / "ssl.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows({"raw pixels": [(0.7, 0.8)], "DCL": [(0.75, 0.83)]}, epochs))
    (tmp_path / "h200-6epochs/ssl_knn.png").write_bytes(b"png")
    text = section(tmp_path, link="../")
    assert text.index("### cpu-10k: cpu, 60,000 training images, 8 epochs") < text.index("### h200-6epochs")
    assert f"](../{tmp_path / 'h200-6epochs/ssl_knn.png'})" in text and text.count("![") == 1
