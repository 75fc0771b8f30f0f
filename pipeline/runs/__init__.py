"""Runs on Ray and their tracking: a job opened and closed once (``job``) by pretraining on Ray Train (``train``) and
the Tune jobs (``tune``, and the ``sweep`` and ``tables`` built on it), connecting to a cluster and waiting for its
resources (``cluster``), MLflow (``tracking``) and every use of Ray or MLflow beyond their public APIs
(``undocumented``). Only what touches Ray or MLflow lives here: the pure rules they follow are on the floors below
(the sweep's space, run names, resource shapes: ``pipeline.config``; the staged data: ``pipeline.data.storage``).

The top floor: it may import every other package of ``pipeline``; none of them imports it.
"""
