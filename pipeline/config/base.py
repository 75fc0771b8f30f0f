"""What every section shares: :class:`ParamsError`, the strict :class:`Section` model, the YAML reader (floats as
YAML 1.2 reads them, a key given twice refused), ``-S key=value`` overrides and the error message that names every
bad key. Imports nothing from ``pipeline``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ParamsError(ValueError):
    """Invalid params: the message names the key(s) and what is allowed."""


class Section(BaseModel):
    # no inf / nan: a float param is a finite number (``.inf`` would pass an upper-bound-free range check)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)


MAX_SEED = 2**32 - 1  # scikit-learn and NumPy seeds are 32-bit


# ----------------------------------------------------------------------------------------------- loading
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser where PyYAML has it: 9x faster
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


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Field names of the section at ``loc`` (the parent of an unknown key)."""
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return list(model.model_fields)


def format_error(err: ValidationError, source: str, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> str:
    """One line per problem of ``err``, each naming its key and what is allowed. ``root`` is the model of the whole
    file; ``prefix`` the path of the section that was validated alone (``("data",)``), or () for the whole file."""
    lines = []
    for e in err.errors():
        loc = prefix + tuple(p for p in e["loc"] if p not in ("function-after", "function-before"))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(root, loc[len(prefix):-1])
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


def set_dotted(raw: dict[str, Any], dotted: str | list[str], value: Any) -> None:
    """``raw["a"]["b"]["c"] = value`` for ``"a.b.c"`` (or ``["a", "b", "c"]``), in place, missing sections created;
    raises :class:`ParamsError` where a step of the path holds a value, not a section."""
    parts = dotted.split(".") if isinstance(dotted, str) else dotted
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            if nxt is not None:
                raise ParamsError(f"{p!r} is a value, not a section")
            nxt = node[p] = {}
        node = nxt
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key=value`` override set (intermediate sections created)."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        try:
            set_dotted(out, parts, value)
        except ParamsError as exc:
            raise ParamsError(f"override {text!r}: {exc}") from None
    return out


def read_params_file(path: str | Path, sections: Iterable[str] = ()) -> dict[str, Any]:
    """The mapping of sections in ``path``; ``sections`` (the ones the reader needs) name what an empty file lacks."""
    wanted = ", ".join(sections) or "its sections"
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
        raise ParamsError(f"{path}: the file is empty; it needs the sections {wanted}")
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections ({wanted}), "
                          f"got {type(raw).__name__}")
    return raw


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



def load_section(path: str | Path, name: str, model: type[BaseModel], overrides: Iterable[str] = ()) -> Any:
    """Read ``path``, apply the ``overrides`` of section ``name`` and validate that section alone as ``model``, with
    the messages of a whole file's validation: a stage that reads one section (``prepare``: ``data``) depends on
    that section's module only, and a bad value elsewhere is left to the stages that read it (``transfusion check``
    validates the whole file). Every override must still be well-formed ``key=value``."""
    raw = apply_overrides(read_params_file(path, (name,)), overrides)
    if name not in raw:
        raise ParamsError(f"invalid params in {path}:\n  {name}: required section is missing")
    try:
        return model.model_validate(raw[name])
    except ValidationError as err:
        raise ParamsError(format_error(err, str(path), model, prefix=(name,))) from None


__all__ = ["MAX_SEED", "ParamsError", "Section", "apply_overrides", "flatten", "format_error", "load_section",
           "parse_override", "read_params_file"]
