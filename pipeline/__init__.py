"""TransFusion as a library: the head for your own backbone, the losses, the targets, the typed configs and the
distributed step, importable from ``pipeline`` itself::

    from pipeline import TransFusionHead, make_loss, self_supervised_ids

    head = TransFusionHead(dim=64, depth=2)
    loss_fn = make_loss("jsd")
    out = head(embeddings)                        # embeddings (2B, 64): [view 1 of B images; view 2]
    loss = loss_fn(out.q, out.k, self_supervised_ids(B))

``docs/api.md`` walks through a plain PyTorch loop and the same on Ray Train.

The exports load lazily (PEP 562): ``import pipeline.config.data`` or ``from pipeline import Params`` imports
neither torch nor the model; the first ``pipeline.TransFusionHead`` imports :mod:`pipeline.core.model`. Each name
is the very object of the module that defines it (the table below). The project's own modules import from those
modules, never through this one (``tests/test_layers.py``), so this file holds no ``import`` of them: it sits
above every floor, and no DVC stage depends on it (``tests/test_dvc_deps.py``). A new export is a line in the table
and one in ``tests/test_public_api.py``'s ``API``. It also keeps the module paths from before the floors importable
(``pipeline.model`` & co., :mod:`pipeline.legacy`), so models pickled into MLflow under them still load.
"""

import importlib as _importlib

from pipeline import legacy as _legacy

_legacy.install()

_EXPORTS: dict[str, str] = {
    # the model: blocks, the head for any backbone, backbone + head, and the project's builder
    "TransFusionBlock": "pipeline.core.model",
    "TransFusionHead": "pipeline.core.model",
    "HeadOutput": "pipeline.core.model",
    "TransFusion": "pipeline.core.model",
    "build_model": "pipeline.core.model",
    "ABCModel": "pipeline.core.model",
    # one block's fusion for a subset of its rows, dense or in column tiles (a row-sharded head calls it)
    "fuse_rows": "pipeline.core.attention",
    # the losses: by name, and each one; all take (q, k, ids, *, rows=None, layout=None)
    "make_loss": "pipeline.core.losses",
    "LOSS_NAMES": "pipeline.core.losses",
    "jsd": "pipeline.core.losses",
    "jsd_appendix_e": "pipeline.core.losses",
    "kl_softmax": "pipeline.core.losses",
    "kl_relu": "pipeline.core.losses",
    "kl_squared": "pipeline.core.losses",
    "infonce": "pipeline.core.losses",
    "supcon": "pipeline.core.losses",
    "dcl": "pipeline.core.losses",
    "barlow_twins": "pipeline.core.losses",
    # ABC (attention-based clustering): the head and its BCE on the kernel, diagonal included
    "ABCHead": "pipeline.core.abc",
    "bce": "pipeline.core.abc",
    # clustering a kernel of unseen classes: k given or by the eigengap (ABC's inference)
    "cluster_kernel": "pipeline.core.clustering",
    "cluster": "pipeline.core.clustering",
    "eigengap_k": "pipeline.core.clustering",
    # the targets of eq. (1)
    "target_affinity": "pipeline.core.targets",
    "self_supervised_ids": "pipeline.core.targets",
    # the distributed step: global-batch fusion over torch.distributed (Ray Train, torchrun)
    "GlobalBatchStep": "pipeline.training.step",
    "NonFiniteLossError": "pipeline.training.step",
    "broadcast_from_rank0": "pipeline.training.step",
    # hooks into the pipeline's pretraining loop (every run and trial: $TRANSFUSION_CALLBACKS)
    "Callback": "pipeline.training.loop",
    # the typed configs of params.yaml
    "Params": "pipeline.config.params",
    "load_params": "pipeline.config.params",
    "validate_params": "pipeline.config.params",
    "ParamsError": "pipeline.config.base",
    "DataConfig": "pipeline.config.data",
    "SyntheticConfig": "pipeline.config.data",
    "ModelConfig": "pipeline.config.model",
    "LossConfig": "pipeline.config.loss",
    "AugmentConfig": "pipeline.config.augment",
    "TrainConfig": "pipeline.config.train",
    "ProbeConfig": "pipeline.config.probe",
    "RayConfig": "pipeline.config.ray",
    "SweepConfig": "pipeline.config.sweep",
    "TheoryConfig": "pipeline.config.theory",
    "TablesConfig": "pipeline.config.tables",
    "AbcConfig": "pipeline.config.model",
    "SetsConfig": "pipeline.config.sets",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    """``pipeline.<name>``: imports the defining module on first use and keeps the name here for the next."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
