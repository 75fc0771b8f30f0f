"""Runs on Ray and their tracking: pretraining on Ray Train (``train``), the Ray Tune machinery (``tune``) and the
jobs built on it (``sweep``, ``tables``), connecting to a cluster and waiting for its resources (``cluster``), the
uses of Ray that no public API offers (``ray_undocumented``), shared storage (``storage``) and MLflow (``tracking``).
Only what touches Ray or MLflow lives here: the pure rules they follow are on the floors below (the sweep's space,
run names, resource shapes: ``pipeline.config``).

The top floor: it may import every other package of ``pipeline``; none of them imports it.
"""
