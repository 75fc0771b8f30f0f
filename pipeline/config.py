"""Typed, validated params: ``params.yaml`` -> :class:`Params`, one config object per concern.

Every section is required; every field inside has a default. Unknown keys, wrong types, out-of-range
values, unknown names and conflicting settings raise :class:`ParamsError`, whose message names each bad
key and what is allowed. Nothing is run or written before validation passes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.augment import PRESETS
from pipeline.backbones import BACKBONE_NAMES, FIXED_DIMS
from pipeline.choices import ACTIVATIONS, BLOCK_NORMS, FUSION_SCOPES, QK_INITS
from pipeline.datasets import DATASET_NAMES
from pipeline.losses import LOSS_NAMES, SELF_SUPERVISED_ONLY
from pipeline.probes import PROBES

BATCHNORM_BACKBONES = ("resnet18_cifar", "resnet18")  # gradient caching is refused with these

DatasetName = Literal[DATASET_NAMES]  # type: ignore[valid-type]
BackboneName = Literal[BACKBONE_NAMES]  # type: ignore[valid-type]
LossName = Literal[LOSS_NAMES]  # type: ignore[valid-type]
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
Activation = Literal[ACTIVATIONS]  # type: ignore[valid-type]
BlockNorm = Literal[BLOCK_NORMS]  # type: ignore[valid-type]
FusionScope = Literal[FUSION_SCOPES]  # type: ignore[valid-type]
QkInit = Literal[QK_INITS]  # type: ignore[valid-type]
ProbeName = Literal[PROBES]  # type: ignore[valid-type]


class ParamsError(ValueError):
    """Invalid params: the message names the key(s) and what is allowed."""


class Section(BaseModel):
    # no inf / nan: a float param is a finite number (``.inf`` would pass an upper-bound-free range check)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)


MAX_SEED = 2**32 - 1  # scikit-learn and NumPy seeds are 32-bit


class SyntheticConfig(Section):
    """Union of K subspaces of rank r in R^m with noise bounded as eq. 8 (``x·x̃ >= 1 - noise``)."""

    n_samples: int = Field(2000, ge=4, le=10_000_000)
    n_clusters: int = Field(10, ge=2, le=10_000)
    rank: int = Field(3, ge=1)
    dim: int = Field(64, ge=2, le=100_000)
    noise: float = Field(0.1, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _independent(self) -> SyntheticConfig:
        if (self.n_clusters - 1) * self.rank >= self.dim:
            raise ValueError(
                f"data.synthetic: (n_clusters - 1) * rank = {(self.n_clusters - 1) * self.rank} must be < dim "
                f"= {self.dim} (the paper's independence assumption); lower rank or n_clusters, or raise dim"
            )
        if self.n_samples < 2 * self.n_clusters:
            raise ValueError("data.synthetic: n_samples must be >= 2 * n_clusters (every class in both splits)")
        return self


class DataConfig(Section):
    dataset: DatasetName = "digits"
    root: str = "data/raw"
    download: bool = False
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    image_size: int | None = Field(None, ge=4, le=4096)
    limit_train: int | None = Field(None, ge=2)
    limit_test: int | None = Field(None, ge=2)
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _image_folder_size(self) -> DataConfig:
        if self.dataset == "image_folder" and self.image_size is None:
            raise ValueError("data.image_size is required for data.dataset: image_folder (e.g. 32)")
        return self


class ModelConfig(Section):
    backbone: BackboneName = "cnn_small"
    embed_dim: int | None = Field(None, ge=2, le=65_536)
    hidden_dim: int = Field(256, ge=2, le=65_536)
    depth: int = Field(1, ge=0, le=64)
    activation: Activation = "relu"
    block_norm: BlockNorm = "layernorm"
    head: Literal["appendix_e", "truncated"] = "appendix_e"
    fusion_scope: FusionScope = "joint"  # joint (Appendix E) | per_view (the authors' later code)
    qk_init: QkInit = "default"  # ours: default (nn.Linear's) | tied (W_K = W_Q) | identity (W_Q = W_K = I)
    weights: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.head == "truncated" and self.depth == 0:
            raise ValueError("model.head: truncated needs model.depth >= 1 (its last block gives the affinity)")
        if self.backbone == "pixels" and self.depth == 0:
            raise ValueError("model.backbone: pixels with model.depth: 0 has nothing to train; use depth >= 1")
        if self.backbone in FIXED_DIMS and self.embed_dim not in (None, FIXED_DIMS[self.backbone]):
            raise ValueError(
                f"model.embed_dim: {self.backbone} produces {FIXED_DIMS[self.backbone]}-d embeddings; "
                f"set embed_dim to null or {FIXED_DIMS[self.backbone]}"
            )
        if self.backbone == "pixels" and self.embed_dim is not None:
            raise ValueError("model.embed_dim: the pixels backbone's width is the input size; set it to null")
        if self.weights is not None and self.backbone != "resnet18":
            raise ValueError("model.weights: only the resnet18 backbone loads weights from a file")
        return self


class LossConfig(Section):
    name: LossName = "jsd"
    temperature: float = Field(0.1, gt=0.0, le=100.0)
    barlow_lambda: float = Field(5e-3, ge=0.0)


class AugmentConfig(Section):
    preset: PresetName = "paper"
    strength: float = Field(1.0, ge=0.0, le=1.0)


class TrainConfig(Section):
    mode: Literal["self_supervised", "supervised"] = "self_supervised"
    epochs: int = Field(20, ge=1, le=100_000)
    batch_size: int = Field(256, ge=2, le=1_000_000)
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    optimizer: Literal["adam", "sgd", "lars"] = "adam"
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    warmup_epochs: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: int = Field(1, ge=1)
    grad_cache_chunk: int | None = Field(None, ge=1)
    knn_every: int = Field(1, ge=0)  # epochs between online kNN evaluations (0 = only at the end)
    knn_k: int = Field(20, ge=1)
    head_lr_scale: float = Field(1.0, gt=0.0, le=1000.0)  # ours: the head's lr = train.lr * this
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # the step's autocast (pipeline.precision)
    # MiB the training set may take on a worker's device (above: streamed from memory-mapped files, same results);
    # None: a share of the device's memory (pipeline.loop.data_budget); 0 always streams
    data_budget_mb: float | None = Field(None, ge=0.0, le=1e9)

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"train.warmup_epochs ({self.warmup_epochs}) must be < train.epochs ({self.epochs})"
            )
        return self


class ProbeConfig(Section):
    """The evaluate stage: probes on frozen embeddings, cluster quality, figures."""

    probes: list[ProbeName] = Field(default_factory=lambda: list(PROBES), min_length=1)
    label_fractions: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.1, 1.0], min_length=1)
    max_train: int | None = Field(10_000, ge=10)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    tsne_points: int = Field(1000, ge=0)  # 0 = no t-SNE figure
    affinity_points: int = Field(500, ge=10)  # test samples in the affinity batch (sharpness, spectral)
    device: Literal["auto", "cpu", "cuda"] = "auto"


class SweepConfig(Section):
    """The sweep stage (Ray Tune): the grid over the paper's two knobs and depth."""

    depth: list[Annotated[int, Field(ge=0, le=64)]] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    batch_size: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: [32, 256], min_length=1)
    strength: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(default_factory=lambda: [0.0, 1.0], min_length=1)
    lr: list[Annotated[float, Field(gt=0.0, le=10.0)]] = Field(default_factory=list)  # empty: keep train.lr
    search: Literal["grid", "random"] = "grid"
    num_samples: int = Field(1, ge=1)  # grid: seeds per point (train.seed + 0, 1, ...); random: sampled points
    epochs: int = Field(6, ge=1)
    asha: bool = False
    grace_period: int = Field(2, ge=1)
    cpus_per_worker: float = Field(0.5, gt=0.0)
    max_concurrent_trials: int | None = Field(None, ge=1)  # None: as many as the cluster's CPUs hold


class TheoryConfig(Section):
    """The theory stage (paper section 3): (a) Theorem 2's γ over a (ρ, ε) grid per batch size n, (b) a head
    trained on union-of-subspaces data over batch size n × noise ε × depth × seed, (c) the two side by side."""

    # (a) the formula: `formula_points` evenly spaced ρ and ε in [0, 1], plus `formula_log_points` geometric ε
    # in [formula_eps_min, 1 / (formula_points - 1)) where the bound is valid at all
    formula_points: int = Field(41, ge=2, le=2001)
    formula_log_points: int = Field(24, ge=0, le=2001)
    formula_eps_min: float = Field(1e-8, gt=0.0, lt=1.0)
    formula_n: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [8, 32, 128, 512], min_length=1)
    # (b) the measurement: supervised JSD training of a TransFusion head on K subspaces of rank r in R^dim
    n: list[Annotated[int, Field(ge=2)]] = Field(default_factory=lambda: [8, 32, 128], min_length=1)
    eps: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6], min_length=1)
    depth: list[Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=lambda: [1, 3], min_length=1)
    steps: int = Field(100, ge=1, le=1_000_000)
    lr: float = Field(0.01, gt=0.0, le=10.0)
    n_clusters: int = Field(4, ge=2, le=10_000)
    rank: int = Field(2, ge=1)
    dim: int = Field(32, ge=2, le=100_000)
    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    learned_nmi: float = Field(0.9, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _consistent(self) -> TheoryConfig:
        problems = []
        if self.formula_eps_min >= 1.0 / (self.formula_points - 1):
            problems.append(f"theory.formula_eps_min ({self.formula_eps_min:g}) must be < 1 / (formula_points - 1) "
                            f"= {1.0 / (self.formula_points - 1):g}")
        if (self.n_clusters - 1) * self.rank >= self.dim:
            problems.append(f"theory.dim: (n_clusters - 1) * rank = {(self.n_clusters - 1) * self.rank} must be < "
                            f"dim = {self.dim} (the paper's independence assumption)")
        if min(self.n) < 2 * self.n_clusters:
            problems.append(f"theory.n: every batch size must be >= 2 * n_clusters = {2 * self.n_clusters} (a "
                            f"same-cluster pair in every cluster of the test batch), got {min(self.n)}")
        for key in ("formula_n", "n", "eps", "depth", "seeds"):
            values = getattr(self, key)
            if len(set(values)) != len(values):
                problems.append(f"theory.{key}: duplicate values in {values}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


ROW_SECTIONS = ("model", "loss", "augment", "train")  # what a row of the tables job may override


class TableRow(Section):
    """One row of the paper's Tables 1-2: a named configuration, and the params it overrides on the file's base."""

    name: str = Field(min_length=1, max_length=200)
    table: Literal[1, 2]  # 1: self-supervised, 2: supervised
    paper: str | None = None  # the paper's row it stands beside (default: the paper's row of the same name, if any)
    params: dict[str, Any] = Field(default_factory=dict)  # dotted overrides, e.g. {"loss.name": infonce}


def _paper_rows() -> list[TableRow]:
    """The paper's rows: Table 1 (self-supervised, the paper's augmentation), Table 2 (supervised, none)."""
    ssl, sup = {"train.mode": "self_supervised"}, {"train.mode": "supervised", "augment.strength": 0.0}
    rows = [("InfoNCE", 1, ssl, "infonce", 0), ("DCL", 1, ssl, "dcl", 0), ("BarlowTwins", 1, ssl, "barlow_twins", 0),
            ("TransFusion 1-Layer", 1, ssl, "jsd", 1), ("TransFusion 9-Layer", 1, ssl, "jsd", 9),
            ("SupCon", 2, sup, "supcon", 0), ("TransFusion 1-Layer", 2, sup, "jsd", 1),
            ("TransFusion 9-Layer", 2, sup, "jsd", 9)]
    return [TableRow(name=n, table=t, params={**base, "loss.name": loss, "model.depth": depth})
            for n, t, base, loss, depth in rows]


class TablesConfig(Section):
    """``transfusion tables``: the paper's Tables 1-2 as one Tune job, an explicit list of rows (not a grid).

    Each row's params are applied to the file's ``model``/``loss``/``augment``/``train``; the rows share the data,
    the cluster (``ray``) and the probes (``probe``). Whether a row's resolved params are valid (e.g. a loss that
    needs self-supervised mode) is checked by ``pipeline.tables.resolve_rows`` before any work.
    """

    rows: list[TableRow] = Field(default_factory=_paper_rows, min_length=1)
    max_concurrent_trials: int | None = Field(None, ge=1)  # None: as many as the cluster holds

    @model_validator(mode="after")
    def _rows(self) -> TablesConfig:
        sections = {"model": ModelConfig, "loss": LossConfig, "augment": AugmentConfig, "train": TrainConfig}
        problems, seen = [], set()
        for i, row in enumerate(self.rows):
            where = f"tables.rows[{i}] ({row.name!r})"
            if (row.table, row.name) in seen:
                problems.append(f"{where}: a second row named {row.name!r} in table {row.table}; names are unique "
                                "within a table")
            seen.add((row.table, row.name))
            for key in row.params:
                section, _, field = key.partition(".")
                if section not in sections:
                    problems.append(f"{where}: params key {key!r}: a row overrides only "
                                    f"{', '.join(s + '.*' for s in ROW_SECTIONS)} (the data, the cluster and the "
                                    "probes are the job's)")
                elif field not in sections[section].model_fields:
                    problems.append(f"{where}: params key {key!r}: unknown key; allowed keys in {section}: "
                                    f"{', '.join(sections[section].model_fields)}")
        if problems:
            raise ValueError("\n  ".join(problems))
        return self


class RayConfig(Section):
    address: str | None = None
    num_workers: int = Field(1, ge=1, le=100_000)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0.0, le=1024.0)
    storage_path: str = "ray_results"  # every node must see it (NFS/EFS mount, or s3://...): checkpoints, staged data
    max_failures: int = Field(0, ge=-1)
    connect_timeout_s: float = Field(30.0, gt=0.0, le=86_400.0)  # wait for ray.address / RAY_ADDRESS to answer
    resources_timeout_s: float = Field(300.0, gt=0.0, le=604_800.0)  # wait for the workers' resources to be free
    # torch.distributed backend of Ray Train's workers: auto = Ray's choice (nccl on GPUs, gloo otherwise); gloo
    # also lets a GPU-scheduled worker on a node that declares GPUs it does not have train on its CPU (rehearsals)
    backend: Literal["auto", "nccl", "gloo"] = "auto"


class Params(Section):
    """All of ``params.yaml``. Each DVC stage depends only on the sections it reads."""

    data: DataConfig
    model: ModelConfig
    loss: LossConfig
    augment: AugmentConfig
    train: TrainConfig
    ray: RayConfig
    probe: ProbeConfig
    sweep: SweepConfig
    theory: TheoryConfig
    # optional (the paper's rows by default); read only by `transfusion tables`, so left out of the params every
    # other stage records (model_dump, MLflow, REPORT.md)
    tables: TablesConfig = Field(default_factory=TablesConfig, exclude=True)

    @model_validator(mode="after")
    def _cross_section(self) -> Params:
        problems = []
        if self.train.mode == "supervised" and self.loss.name in SELF_SUPERVISED_ONLY:
            problems.append(
                f"loss.name: {self.loss.name} needs train.mode: self_supervised (one positive per row); "
                "for supervised training use jsd, jsd_appendix_e, kl_softmax, kl_relu, kl_squared, supcon or dcl"
            )
        image_backbones = ("cnn_small", "resnet18_cifar", "resnet18")
        if self.data.dataset == "synthetic" and self.model.backbone in image_backbones:
            problems.append(
                f"model.backbone: {self.model.backbone} needs images, but data.dataset: synthetic gives "
                "vectors; use pixels or mlp"
            )
        if self.train.batch_size % self.ray.num_workers:
            problems.append(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of ray.num_workers "
                f"({self.ray.num_workers}): it is the global batch, split evenly over the workers"
            )
        if self.ray.use_gpu and self.train.device == "cpu":
            problems.append("ray.use_gpu: true conflicts with train.device: cpu")
        if self.train.grad_cache_chunk is not None and self.model.backbone in BATCHNORM_BACKBONES:
            problems.append(
                f"train.grad_cache_chunk: gradient caching is not exact with the BatchNorm backbone "
                f"{self.model.backbone}: its chunks would put the two views of an image in different BatchNorm "
                "batches and update the running statistics in both passes; set train.grad_cache_chunk: null "
                "or use a backbone without BatchNorm (pixels, mlp, cnn_small)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


SECTIONS = tuple(Params.model_fields)


# ----------------------------------------------------------------------------------------------- loading
class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float (YAML 1.2, as DVC does) instead of a string, and refuses a key
    given twice in one mapping (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from PyYAML's multi-line error: ``expected ',' or ']' at line 2, column 1 (while parsing ...)``."""
    def at(mark: Any) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())
    text = f"{exc.problem or exc.context or 'syntax error'}{at(exc.problem_mark or exc.context_mark)}"
    if exc.problem and exc.context:
        text += f" ({exc.context}{at(exc.context_mark)})"
    return text


def _allowed_keys(loc: tuple[Any, ...]) -> list[str] | None:
    """Field names of the section at ``loc`` (the parent of an unknown key)."""
    model: type[BaseModel] = Params
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return list(model.model_fields)


def _format(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after", "function-before"))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            extra = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
            lines.append(f"{key}: unknown key{extra}")
        elif e["type"] == "missing":
            lines.append(f"{key}: required section is missing")
        elif e["type"] == "model_type" and e.get("input") is None:
            lines.append(f"{key}: the section is empty; give it keys, or {{}} for all the defaults")
        elif e["type"] == "value_error":
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if not isinstance(got, dict) else ""
            lines.append(f"{key}: {e['msg']}{shown}")
    return f"invalid params in {source}:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"model.depth=3"`` -> (["model", "depth"], 3); the value is parsed as YAML, like DVC's ``-S``."""
    if "=" not in text:
        raise ParamsError(f"override {text!r}: expected key=value, e.g. -S model.depth=3")
    key, _, raw = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ParamsError(f"override {text!r}: bad key {key!r}; keys look like section.name")
    try:
        value = _yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ParamsError(f"override {text!r}: value is not valid YAML: {_yaml_problem(exc)}; quote it or fix "
                          "the syntax, e.g. -S 'probe.probes=[svm, knn50]'") from exc
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key=value`` override set (intermediate sections created)."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                if nxt is not None:
                    raise ParamsError(f"override {text!r}: {p!r} is a value, not a section")
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = value
    return out


def validate_params(raw: Mapping[str, Any], source: str = "params") -> Params:
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(raw).__name__}")
    try:
        return Params.model_validate(dict(raw))
    except ValidationError as err:
        raise ParamsError(_format(err, source)) from None


def read_params_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"params file {str(path)!r} not found (pass --params PATH or run in the project root)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded); save it as UTF-8 "
                          "YAML") from exc
    except OSError as exc:
        raise ParamsError(f"params file {str(path)!r} cannot be read ({exc.strerror or exc})") from exc
    try:
        raw = _yaml(text)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {_yaml_problem(exc)}; fix it (nested keys indented by "
                          "two spaces, `key: value`, lists as [a, b], each key once)") from exc
    if raw is None:
        raise ParamsError(f"{path}: the file is empty; it needs the sections {', '.join(SECTIONS)}")
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(raw).__name__}")
    return raw


def load_params(path: str | Path = "params.yaml", overrides: Iterable[str] = ()) -> Params:
    """Read, override and validate ``path``. Raises :class:`ParamsError` with every problem listed."""
    raw = apply_overrides(read_params_file(path), overrides)
    return validate_params(raw, source=str(path))


def flatten(params: BaseModel | Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.depth": 1, ...}`` — flat keys for trackers and tables."""
    data = params.model_dump() if isinstance(params, BaseModel) else params
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


__all__ = [
    "AugmentConfig", "DataConfig", "LossConfig", "ModelConfig", "Params", "ParamsError", "ProbeConfig", "RayConfig",
    "SweepConfig",
    "SyntheticConfig", "TableRow", "TablesConfig",
    "TheoryConfig", "TrainConfig", "apply_overrides", "flatten", "load_params", "validate_params",
]
