"""Runs on Ray and their tracking: pretraining on Ray Train (``train``), the Ray Tune machinery (``tune``) and the
jobs built on it (``sweep``, ``tables``), rehearsals of a params file (``rehearse``), connecting to a cluster and
sizing what it can run (``cluster``, ``resources``), shared storage (``storage``), MLflow (``tracking``) and the
MLflow UI server (``mlflow_ui``).

The top floor: it may import every other package of ``pipeline``; none of them imports it.
"""
