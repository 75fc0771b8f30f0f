"""The training step and loop, on one process or many: global-batch fusion over ``torch.distributed``, gradient
buckets reduced during the backward (``comm``), precision by device, the epoch loop with checkpoints, online kNN
and health, and the counters the tests and benchmarks use (``measure``: peak memory, collectives, host syncs).

May import everything below it (ground floor, ``core``, ``data``, ``theory``, ``evaluation``); never Ray or MLflow:
Ray Train calls it from ``pipeline.runs``.
"""
