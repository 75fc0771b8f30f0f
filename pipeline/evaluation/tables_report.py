"""The tables job's outputs (``pipeline.runs.tables``) as people read them: ``reports/TABLES.md`` (:func:`render`),
the rows of ``tables/results.csv`` (:func:`csv_records`, :data:`COLUMNS`; :func:`read_records` reads them back), the
per-epoch ``tables/curves.csv`` (:func:`curve_rows`) and its figure (:func:`curves_figure`). Everything here renders
from those files, so a table or figure regenerates without retraining (``transfusion tables --render``).

A row ran once per seed (``tables.seeds``); :func:`aggregate` turns its seeds into one line: the mean and the sample
standard deviation of each number over the seeds that finished. The controls (``tables.controls``: the raw pixels,
the backbone at its random initialisation) stand in every table, above the trained rows. For the headline probes
(:data:`HEADLINE`), :func:`statistics_section` adds each row's 95 % confidence interval of the mean
(:func:`confidence_interval`) and, when ``tables.reference`` names a row, a paired t-test by seed of every row of its
table against it (:func:`paired_test`)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy import stats

from pipeline.config.params import Params
from pipeline.config.probe import PROBES as ALL_PROBES
from pipeline.evaluation.health import KERNEL, dead_blocks, is_health_key, unflat
from pipeline.evaluation.report import HEADER, NA, PAPER_TABLES, RULE, fmt_cell, table_row
from pipeline.evaluation.tuning_report import chosen_points, tuning_section
from pipeline.plots import new_figure, save_figure

PROBES = ("ffn", "svm", "knn50", "knn200")  # the paper's columns, in the order of report.COLUMNS
PROBE_NAMES = {"ffn": "3-FFN", "svm": "SVM", "knn50": "K-NN (k=50)", "knn200": "K-NN (k=200)",
               "logreg": "logistic regression"}
COLUMNS = ("table", "name", "paper", "seed", "control", "trial_id", "train.mode", "loss.name", "model.depth",
           "model.projector", "model.head", "fusing", "head", "model.backbone", "train.batch_size", "epochs",
           *ALL_PROBES, "knn_acc", "train_minutes", "fit_seconds", "eval_seconds", "workers", "gpus", "hours",
           "hours_unit", "probe_cpus", "probe_gpus", "status", "error")
CURVE_COLUMNS = ("table", "name", "seed", "epoch", "seconds")  # then the per-epoch metrics, then the health
AVERAGED = (*ALL_PROBES, "knn_acc", "train_minutes", "hours")  # what aggregate() averages over seeds
RISE = 0.005  # the online kNN "stops rising" at the first epoch that no later epoch beats by more than this
HEADLINE = ("knn200", "logreg")  # the probes statistics_section() reads, those the rows have
LEVEL = 0.05  # the paired test's level: a row is ahead of (behind) the reference only when p < LEVEL
TEST = "paired t-test by seed, two-sided"
FLAT = 1e-12  # per-seed differences this close are one number (accuracies are in [0, 1]; float noise is ~1e-16)
TEXT = ("name", "paper", "control", "trial_id", "train.mode", "loss.name", "model.projector", "model.head", "head",
        "model.backbone", "hours_unit", "status", "error")


# ------------------------------------------------------------------------------------------- records
def csv_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tables/results.csv`` rows: a number we could not compute is "n/a"."""
    return [{k: NA if r.get(k) is None or (isinstance(r.get(k), float) and not math.isfinite(r[k])) else r[k]
             for k in COLUMNS} for r in records]


def _number(v: str) -> int | float | None:
    if v in (NA, "", "None"):
        return None
    f = float(v)
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def read_records(path: Path) -> list[dict[str, Any]]:
    """``tables/results.csv`` back as records (numbers as numbers, "n/a" as None); each gets its ``index``: the order
    of its row in the file (controls first, as written)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    out, order = [], {}
    for r in rows:
        rec = {k: (v if k in TEXT else _number(v)) for k, v in r.items()}
        rec["error"] = rec.get("error") or ""
        rec["control"] = rec.get("control") or ""
        rec["index"] = order.setdefault((rec["table"], rec["name"]), len(order))
        out.append(rec)
    return out


def curve_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tables/curves.csv``: one line per trained (row, seed) and epoch: every number of its kept epoch record
    (``pipeline.training.loop.epoch_record``: the per-epoch metrics, then the blocks' health), except that
    ``seconds`` is the wall-clock seconds of training so far (the online kNN and health included)."""
    out = []
    for r in records:
        seconds = 0.0
        for h in r.get("history") or []:
            seconds += float(h.get("seconds") or 0.0)
            out.append({"table": r["table"], "name": r["name"], "seed": r["seed"], **h, "epoch": int(h["epoch"]),
                        "seconds": round(seconds, 2)})
    return out


def curve_columns(curves: list[dict[str, Any]]) -> list[str]:
    """:data:`CURVE_COLUMNS`, then the per-epoch metrics the curves carry (in their order), then the health keys
    (sorted)."""
    keys = [k for k in dict.fromkeys(k for c in curves for k in c) if k not in CURVE_COLUMNS]
    return [*CURVE_COLUMNS, *(k for k in keys if not is_health_key(k)), *sorted(k for k in keys if is_health_key(k))]


def read_curves(path: Path) -> list[dict[str, Any]]:
    """``tables/curves.csv`` back ([] when it is not there)."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: (v if k == "name" else _number(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def _mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per row (in record order): its first record's identity, ``seeds`` (every seed), ``finished`` (the
    seeds that finished), and for each of :data:`AVERAGED` the mean over the finished seeds (None: none) and
    ``<key>_sd``, their sample standard deviation (0 for one seed); ``status`` TERMINATED if any seed finished;
    ``failures``: ``(seed, error)`` of the others."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["index"], []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "TERMINATED"]
        line = {**group[0], "seeds": [r["seed"] for r in group], "finished": [r["seed"] for r in ok],
                "status": "TERMINATED" if ok else "ERROR",
                "failures": [(r["seed"], r["error"]) for r in group if r["status"] != "TERMINATED"],
                "epochs": max((r["epochs"] for r in ok), default=max(r["epochs"] or 0 for r in group))}
        for k in AVERAGED:
            line[k], line[f"{k}_sd"] = _mean_sd([float(r[k]) for r in ok if r.get(k) is not None])
        out.append(line)
    return out


def cell(line: dict[str, Any], key: str, digits: int = 4) -> str:
    """An aggregated number: ``0.6840`` (one seed), ``0.6840 ± 0.0130`` (several), "n/a" (none finished)."""
    if line.get(key) is None:
        return NA
    value = fmt_cell(float(line[key]), digits)
    return value if len(line["finished"]) < 2 else f"{value} ± {fmt_cell(float(line[f'{key}_sd']), digits)}"


def render(records: list[dict[str, Any]], params: Params, unit: str, dataset: str,
           figure: str | None = None, curves: list[dict[str, Any]] | None = None,
           tuning: list[dict[str, Any]] | None = None) -> str:
    """``reports/TABLES.md``: Tables 1-2 in the paper's layout, each of our rows under the paper's row it reproduces
    (ours in bold, mean ± sd over its seeds; "n/a": not computed) with the controls above them and the cost of each
    row in ``unit``; then every probe of every row; then the statistics over seeds of the headline probes, each row
    against ``tables.reference`` (:func:`statistics_section`); then, from ``curves`` (``tables/curves.csv``), when
    each row's online kNN stopped rising (:func:`rise_table`) and its blocks' health (:func:`health_table`); then
    ``figure`` (a path from the report's folder), if any; first, the tuning phase on the validation split
    (``tuning``: its records, :func:`~pipeline.evaluation.tuning_report.tuning_section`), when rows were tuned."""
    m, t = params.model, params.train
    lines_ = aggregate(records)
    seeds = sorted({s for line in lines_ for s in line["seeds"]})
    probes = [k for k in ALL_PROBES if any(line.get(k) is not None for line in lines_)]
    lines = [
        "# The paper's Tables 1-2, reproduced",
        "",
        f"Ours: dataset **{dataset}**, backbone `{m.backbone}`, {t.epochs} epochs (unless a row says otherwise), "
        f"augmentation `{params.augment.preset}`, {params.ray.num_workers} worker(s) per row, seeds "
        f"{', '.join(map(str, seeds))} (a cell: the mean ± the sample standard deviation over the seeds). Probes on "
        "the frozen backbone embeddings of the test split (" + ", ".join(PROBE_NAMES[k] for k in probes) + "), "
        "fitted on 100 % of the train labels"
        + (f" (at most {params.probe.max_train} samples)" if params.probe.max_train else "")
        + ". Time: our training minutes per seed. The paper's rows are CIFAR-10 with ResNet-18 for 200 epochs: "
        "compare values only if ours is that recipe.",
        "",
    ]
    controls = [line for line in lines_ if line["control"]]
    for table, (caption, paper_rows) in PAPER_TABLES.items():
        ours = [r for r in lines_ if r["table"] == table]
        if not ours:
            continue
        lines += [f"## {caption}", "", HEADER + f" {unit} |", RULE + "---|"]
        lines += [table_row(f"control: {c['name']}", "-", tuple(cell(c, k) for k in PROBES), "-", "-")
                  for c in controls]
        placed = set()
        for name, batch, accs, minutes in paper_rows:
            lines.append(table_row(f"paper: {name}", batch, accs, minutes, "-"))
            for r in ours:
                if r["paper"] == name and r["index"] not in placed and (
                        r["train.batch_size"] == batch or not any(n == name and b == r["train.batch_size"]
                                                                  for n, b, *_ in paper_rows)):
                    lines.append(_our_row(r))
                    placed.add(r["index"])
        lines += [_our_row(r) for r in ours if r["index"] not in placed]
        lines.append("")
    failed = [(r, seed, error) for r in lines_ for seed, error in r["failures"]]
    if failed:
        lines += ["Runs that failed (their numbers are n/a, and left out of the means):", ""]
        lines += [f"- {'control' if r['control'] else 'table ' + str(r['table'])} **{r['name']}**, seed {seed}: "
                  f"{error}" for r, seed, error in failed]
        lines.append("")
    lines += tuning_section(tuning or [], params)
    lines += ["## Every probe, mean ± sd over seeds", "", *probe_table(lines_), ""]
    lines += statistics_section(records, params.tables.reference)
    rise, health = rise_table(curves or []), health_table(curves or [])
    if rise:
        lines += ["## When the online kNN stops rising", "",
                  f"The online kNN of each epoch on the validation split, mean over seeds; it stops rising at the "
                  f"first epoch that no later epoch beats by more than {RISE} (at the last epoch: still rising when "
                  "the run ended).", "",
                  *rise, ""]
    if health:
        lines += ["## Fusion health at the last epoch", "",
                  "Each TransFusion block's attention on a stratified batch (`pipeline/evaluation/health.py`), mean "
                  "± sd over seeds: the last block's entropy (1 = uniform) and its share to the image's other view and "
                  "to the same class; the weakest block's positive query-key pairs and the most uniform block's "
                  "uniform rows; the seeds with a dead block (< 1 % positive pairs).", "", *health, ""]
    if figure:
        lines += [f"![online kNN per epoch, mean over seeds]({figure})", ""]
    chosen = chosen_points(tuning or [])
    lines += ["Rows and their params (as written; a tuned row's chosen point, on the validation split, after them):",
              "", "| table | row | params | chosen |", "|---|---|---|---|"]
    lines += [f"| {r.table} | {r.name} | `{json.dumps(r.params, sort_keys=True)}` | "
              + (f"`{chosen[i]['point']}` |" if i in chosen else "untuned |" if not r.space else f"{NA} |")
              for i, r in enumerate(params.tables.rows)]
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class PairedResult:
    """A row against the reference over the seeds both finished (:func:`paired_test`)."""

    n: int  # pairs: the seeds both rows finished
    diff: float | None  # the mean over those seeds of (row - reference); None: no pair
    p: float | None  # the two-sided p-value of the paired t-test; None: no test (see word)
    word: str  # ahead | behind | tie | n/a


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The Student-t interval of the mean of ``values`` (one per seed, independent): mean ± t_{(1+level)/2, n-1} ·
    sd / √n, sd the sample standard deviation; None under 2 values (one seed has no spread to read)."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def paired_test(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float], level: float = LEVEL) -> PairedResult:
    """Row ``a`` against the reference ``b`` (``{seed: value}`` each), paired by seed over the seeds both have:
    the paired t-test (``scipy.stats.ttest_rel``), two-sided. The verdict: "ahead" (p < ``level``, mean difference
    > 0), "behind" (p < ``level``, < 0), "tie" (p >= ``level``: no difference the seeds tell apart from their spread;
    not a proof of equality). Where the test is undefined there is no p-value: "n/a" under 2 pairs, and "n/a" when
    every pair differs by the same nonzero amount (no spread: t is a division by zero, and saying "ahead" would claim
    more than two or three seeds show); "tie" when every pair is equal (the rows agree on every seed)."""
    seeds = sorted(set(a_by_seed) & set(b_by_seed))
    a, b = [a_by_seed[s] for s in seeds], [b_by_seed[s] for s in seeds]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if not diffs:
        return PairedResult(0, None, None, NA)
    diff = statistics.mean(diffs)
    if len(diffs) < 2:
        return PairedResult(1, diff, None, NA)
    if max(diffs) - min(diffs) <= FLAT:  # no spread: the t statistic is undefined
        return PairedResult(len(diffs), diff, None, "tie" if abs(diff) <= FLAT else NA)
    p = float(stats.ttest_rel(a, b).pvalue)
    return PairedResult(len(diffs), diff, p, "tie" if p >= level else "ahead" if diff > 0 else "behind")


def per_seed(records: list[dict[str, Any]], key: str) -> dict[int, dict[int, float]]:
    """``{row index: {seed: value of key}}`` over each row's finished seeds (a seed without the value left out)."""
    out: dict[int, dict[int, float]] = {}
    for r in records:
        if r["status"] == "TERMINATED" and r.get(key) is not None:
            out.setdefault(r["index"], {})[int(r["seed"])] = float(r[key])
    return out


def _groups(lines_: list[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(table, its lines)`` for each table of the trained rows, in table order, the controls (which stand in every
    table) first in each; the controls alone as table 0 when no row trained."""
    controls = [x for x in lines_ if x["control"]]
    tables = sorted({x["table"] for x in lines_ if not x["control"]})
    return [(t, [*controls, *(x for x in lines_ if not x["control"] and x["table"] == t)]) for t in tables] or [
        (0, controls)]


def _reference(group: list[dict[str, Any]], reference: str) -> dict[str, Any] | None:
    """The line of ``group`` that ``reference`` names: a trained row's name, else a control's key or name."""
    trained = [x for x in group if not x["control"] and x["name"] == reference]
    controls = [x for x in group if x["control"] and reference in (x["name"], x["control"])]
    return (trained + controls)[0] if trained + controls else None


def _p(p: float | None) -> str:
    """A p-value to 3 significant digits (0.0496, not a rounded 0.050 beside the 5 % verdict); "< 0.001" below."""
    return NA if p is None else "< 0.001" if p < 0.001 else f"{p:.3g}"


def _comparison(res: PairedResult) -> str:
    """The cells difference | p | test | verdict of a row against its table's reference."""
    if res.p is not None:
        test = f"{TEST}, {res.n} seeds"
    elif res.n < 2:
        test = f"none: {res.n} seed{'' if res.n == 1 else 's'} in common"
    else:
        test = "none: equal on every seed" if res.word == "tie" else "none: the same difference on every seed"
    diff = NA if res.diff is None else f"{res.diff:+.4f}"
    return f"{diff} | {_p(res.p)} | {test} | {res.word} |"


def statistics_table(records: list[dict[str, Any]], key: str, reference: str | None) -> list[str]:
    """Markdown lines: each row's ``key`` over its finished seeds, per table (:func:`_groups`): the seeds, mean ± sd,
    the 95 % confidence interval of the mean (:func:`confidence_interval`), and with a ``reference`` (a row's name)
    the row against its table's reference (:func:`paired_test`): difference, p-value, test, verdict ("reference" on
    its own line; n/a in a table without it). Without a reference, the first five columns only."""
    lines_, values = aggregate(records), per_seed(records, key)
    compare = reference is not None
    lines = ["| row | table | seeds | mean ± sd | 95 % CI |" + (
        f" difference from {reference} | p | test | verdict at {LEVEL * 100:g} % |" if compare else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if compare else "")]
    for table, group in _groups(lines_):
        ref = _reference(group, reference) if reference is not None else None
        for x in group:
            mine = values.get(x["index"], {})
            ci = confidence_interval(list(mine.values()))
            line = (f"| {'control: ' if x['control'] else ''}{x['name']} | {table or '-'} | {len(mine)} | "
                    f"{_spread(list(mine.values()), 4)} | {NA if ci is None else f'[{ci[0]:.4f}, {ci[1]:.4f}]'} |")
            if compare and ref is None:
                line += f" {NA} | {NA} | no reference row in this table | {NA} |"
            elif compare and x is ref:
                line += " - | - | - | reference |"
            elif compare and ref is not None:
                line += " " + _comparison(paired_test(mine, values.get(ref["index"], {})))
            lines.append(line)
    return lines


def statistics_section(records: list[dict[str, Any]], reference: str | None) -> list[str]:
    """Markdown lines: ``## Statistics over seeds (<probe>)`` for each of :data:`HEADLINE` the rows have, its
    :func:`statistics_table`, the first with a paragraph saying how to read it; [] when the rows have neither."""
    lines_ = aggregate(records)
    probes = [k for k in HEADLINE if any(line.get(k) is not None for line in lines_)]
    names = {x["name"] for x in lines_} | {x["control"] for x in lines_ if x["control"]}
    known = reference is not None and reference in names
    intro = ("Each row over the seeds that finished: their number, the mean ± the sample sd, and the 95 % confidence "
             "interval of the mean (Student t: mean ± t(0.975, n - 1) · sd / √n; n/a under 2 seeds).")
    if known:
        intro += (f" Against the reference row **{reference}** (`tables.reference`) of its table (the controls stand "
                  "in every table): the difference, the mean over the seeds both finished of (row - reference); the "
                  f"{TEST}; its p-value; and the verdict at {LEVEL * 100:g} %: ahead or behind when p < {LEVEL}, "
                  "else tie (no difference the seeds tell from their spread). n/a: under 2 seeds in common, or the "
                  "same nonzero difference on every seed (no spread to test). The seeds are the only replicates: a "
                  "verdict holds for this setup (data, epochs, backbone), not beyond it.")
    elif reference is not None:
        intro += f" `tables.reference` ({reference}) is not a row of these results: no comparison."
    else:
        intro += (" Set `tables.reference` to a row's name to test every row of its table against it "
                  f"({TEST}).")
    out: list[str] = []
    for i, k in enumerate(probes):
        out += [f"## Statistics over seeds ({PROBE_NAMES[k]})", "", *([intro, ""] if i == 0 else []),
                *statistics_table(records, k, reference if known else None), ""]
    return out


def probe_table(lines_: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: every probe of every aggregated row (:func:`aggregate`), mean ± sd over its seeds, with its
    head (its projector and how many of its blocks fuse: ``pipeline.config.names.head_description``; "-" for a
    control, "n/a" for a record written before rows had one), finished seeds, epochs, last online kNN and training
    minutes a seed."""
    probes = [k for k in ALL_PROBES if any(line.get(k) is not None for line in lines_)]
    lines = ["| row | table | head | seeds | epochs | " + " | ".join(PROBE_NAMES[k] for k in probes)
             + " | online kNN, last epoch | train min / seed |",
             "|---|---|---|---|---|" + "---|" * len(probes) + "---|---|"]
    for r in lines_:
        where = "control" if r["control"] else str(r["table"])
        head = "-" if r["control"] else r.get("head") or NA
        lines.append(f"| {r['name']} | {where} | {head} | {len(r['finished'])}/{len(r['seeds'])} | {r['epochs']} | "
                     + " | ".join(cell(r, k, 3) for k in probes)
                     + f" | {cell(r, 'knn_acc', 3) if not r['control'] else '-'} | "
                     + (f"{r['train_minutes']:.1f} |" if r["train_minutes"] is not None and not r["control"]
                        else "- |"))
    return lines


def _by_row(curves: list[dict[str, Any]]) -> dict[tuple[Any, str], list[dict[str, Any]]]:
    """The curve lines of each trained (table, row), in the order the rows first appear."""
    out: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for c in curves:
        out.setdefault((c["table"], c["name"]), []).append(c)
    return out


def _spread(values: Sequence[float], digits: int = 3) -> str:
    mean, sd = _mean_sd(values)
    if mean is None:
        return NA
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if len(values) > 1 else "")


def rise_table(curves: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each row's online kNN per epoch (mean over its seeds) read for its budget: at the first epoch,
    its best (and at which epoch), at the last, and the epoch where it stops rising: the first epoch ``e`` with no
    later epoch above ``knn(e) + RISE``. [] when no row has an online kNN on 2 epochs or more."""
    lines = []
    for (table, name), mine in _by_row(curves).items():
        epochs = sorted({int(c["epoch"]) for c in mine if c.get("knn_acc") is not None})
        if len(epochs) < 2:
            continue
        knn = [statistics.mean(float(c["knn_acc"]) for c in mine
                               if int(c["epoch"]) == e and c.get("knn_acc") is not None) for e in epochs]
        best = max(range(len(knn)), key=lambda i: (knn[i], -i))
        stops = next(e for i, e in enumerate(epochs) if all(k <= knn[i] + RISE for k in knn[i + 1:]))
        lines.append(f"| {name} | {table} | {epochs[-1]} | {knn[0]:.3f} | {knn[best]:.3f} (epoch {epochs[best]}) | "
                     f"{knn[-1]:.3f} | {stops if stops < epochs[-1] else f'{stops} (still rising)'} |")
    return ["| row | table | epochs | online kNN, epoch 1 | best | last | stops rising at epoch |",
            "|---|---|---|---|---|---|---|", *lines] if lines else []


def health_table(curves: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each row with TransFusion blocks, their health at each seed's last epoch (the ``block_*``
    columns of ``tables/curves.csv``), mean ± sd over the seeds; [] when no row has a block."""
    lines = []
    for (table, name), mine in _by_row(curves).items():
        last: dict[Any, dict[str, Any]] = {}
        for c in mine:
            if c["seed"] not in last or int(c["epoch"]) > int(last[c["seed"]]["epoch"]):
                last[c["seed"]] = c
        # a block the row does not have is empty in curves.csv (its columns come from the deepest row)
        seeds = [{b: h for b, h in unflat(c).items() if b != KERNEL and h.get("positive") is not None}
                 for c in last.values()]
        seeds = [h for h in seeds if h]
        if not seeds:
            continue

        lasts = [list(h.values())[-1] for h in seeds]  # each seed's last block
        entropy, other, same = (_spread([float(b[k]) for b in lasts if b.get(k) is not None])
                                for k in ("entropy", "other_view", "same_class"))
        weakest = _spread([min(float(b["positive"]) for b in h.values()) for h in seeds])
        uniform = _spread([max(float(b["uniform_rows"]) for b in h.values()) for h in seeds])
        dead = sum(bool(dead_blocks(h)) for h in seeds)
        lines.append(f"| {name} | {table} | {len(seeds[0])} | {entropy} | {other} | {same} | {weakest} | {uniform} | "
                     f"{dead}/{len(seeds)} |")
    return ["| row | table | blocks | entropy | other view | same class | weakest block: positive pairs | most "
            "uniform block: uniform rows | seeds with a dead block |", "|---|---|---|---|---|---|---|---|---|",
            *lines] if lines else []


def curves_figure(curves: list[dict[str, Any]], png: Path) -> None:
    """The online kNN of every row (mean over its seeds) against epochs and against wall-clock seconds of training,
    one line per row, written atomically to ``png``."""
    fig = new_figure(11, 4)
    axes = fig.subplots(1, 2, sharey=True)
    keyed = _by_row([c for c in curves if c.get("knn_acc") is not None])
    tables = {t for t, _ in keyed}
    for (table, name), mine in keyed.items():
        epochs = sorted({int(c["epoch"]) for c in mine})
        knn = [statistics.mean(float(c["knn_acc"]) for c in mine if c["epoch"] == e) for e in epochs]
        secs = [statistics.mean(float(c["seconds"]) for c in mine if c["epoch"] == e) for e in epochs]
        label = name if len(tables) == 1 else f"{name} (table {table})"
        axes[0].plot(epochs, knn, marker=".", label=label)
        axes[1].plot(secs, knn, marker=".", label=label)
    axes[0].set(xlabel="epoch", ylabel="online kNN accuracy (mean over seeds)")
    axes[1].set(xlabel="wall-clock seconds of training (kNN and health included)")
    if keyed:
        axes[0].legend(fontsize=8)
    fig.suptitle("tables job: online kNN per epoch")
    save_figure(fig, png, None, None)


def _our_row(r: dict[str, Any]) -> str:
    """An aggregated row in the paper's layout."""
    accs = tuple(cell(r, k) for k in PROBES)
    minutes = NA if r["train_minutes"] is None else float(r["train_minutes"])
    hours = NA if r["hours"] is None else fmt_cell(float(r["hours"]))
    return table_row(f"**ours: {r['name']}**", r["train.batch_size"], accs, minutes, hours)


STUDIES = Path("studies")  # recorded tables jobs: `transfusion tables --out studies/<name>`, one folder each


def studies_section(dataset: str, studies: Path = STUDIES, link: str = "../") -> str:
    """``## Recorded studies on <dataset>``: for each folder of ``studies`` whose job (``tables/results.json``) ran on
    ``dataset``, its every-probe table (:func:`probe_table`) and its curves figure; "" when there is none. ``link``
    is the path from the report's folder to the project's root."""
    parts = []
    for folder in sorted(p for p in studies.glob("*") if (p / "tables/results.json").is_file()):
        job = json.loads((folder / "tables/results.json").read_text())
        if job["dataset"] != dataset:
            continue
        data, train = job["params"]["data"], job["params"]["train"]
        images = f"{data['limit_train']:,}" if data["limit_train"] else "all"
        lines_ = aggregate(read_records(folder / "tables/results.csv"))
        parts.append(f"### {folder.name}: {images} training images, {train['epochs']} epochs, batch "
                     f"{train['batch_size']}\n\n" + "\n".join(probe_table(lines_)))
        if (folder / "plots/tables/curves.png").is_file():
            parts.append(f"![online kNN per epoch, {folder.name}]({link}{folder / 'plots/tables/curves.png'})")
    if not parts:
        return ""
    head = (f"## Recorded studies on {dataset}\n\nEach a `transfusion tables --out {studies}/<name>` job "
            "(docs/results.md has the commands): probes on the test images, mean ± sd over seeds, controls first.")
    return "\n\n".join([head, *parts]) + "\n"
