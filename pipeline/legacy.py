"""The module paths before ``pipeline/`` had floors, kept importable as aliases of the modules that now hold them.

A model logged to MLflow before the move was pickled with its classes' old paths (``pipeline.model.TransFusion``,
``pipeline.backbones...``, ``pipeline.batchnorm...``); unpickling imports those paths. :func:`install` puts a finder
on ``sys.meta_path`` that answers each old path with the module that now holds its code (the same module object, so
the classes are the same classes). Where one old module was split, the alias is the part that kept the module's main
names (``pipeline.losses`` -> ``pipeline.core.losses``). New code imports the new paths; nothing in the project imports
an alias (tests/test_layers.py). The ground floor: imports only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

OLD_PATHS = {
    "pipeline.model": "pipeline.core.model", "pipeline.backbones": "pipeline.core.backbones",
    "pipeline.batchnorm": "pipeline.core.batchnorm", "pipeline.losses": "pipeline.core.losses",
    "pipeline.optim": "pipeline.core.optim", "pipeline.clustering": "pipeline.core.clustering",
    "pipeline.datasets": "pipeline.data.sources", "pipeline.augment": "pipeline.data.augment",
    "pipeline.knn": "pipeline.evaluation.knn",
    "pipeline.probes": "pipeline.evaluation.probes", "pipeline.health": "pipeline.evaluation.health",
    "pipeline.step": "pipeline.training.step", "pipeline.comm": "pipeline.training.comm",
    "pipeline.loop": "pipeline.training.loop", "pipeline.precision": "pipeline.training.precision",
    "pipeline.choices": "pipeline.config.model",
}
# `pipeline.config` and `pipeline.theory` are packages now, under their old names: a model pickles nothing of them


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:  # the target ran already
        pass


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds ``pipeline.model`` & co. (:data:`OLD_PATHS`) as the modules that now hold their code."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = OLD_PATHS.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())


__all__ = ["OLD_PATHS", "OldPathFinder", "install"]
