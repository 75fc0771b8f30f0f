"""Runs on Ray and their tracking: a job's life (``job``), pretraining on Ray Train (``train``), the Tune jobs
(``tune``; ``sweep``, ``tables``), the cluster (``cluster``), MLflow (``tracking``) and every use of Ray or MLflow
beyond their public APIs (``undocumented``). The pure rules they follow live on the floors below (``pipeline.config``,
``pipeline.data.storage``). The top floor: it may import every other package of ``pipeline``; none of them imports it.
"""
