"""The ground floor: ``params.yaml`` validated into typed configs, one module per section (``data``, ``model``,
``loss``, ``augment``, ``train``, ``probe``, ``ray``, ``sweep``, ``theory``, ``tables``) and ``params`` for the
whole file. Each section's allowed names are plain literals here, so that a stage depends only on the sections it
reads: ``prepare`` reads ``base`` and ``data``, and a new loss name never re-runs it. Beside them, the pure rules
over params that the stages check before any work: the sweep's space (``space``), a rehearsal's sizes
(``rehearse``), what a run asks of Ray's nodes (``resources``) and what runs are called (``names``).

Imports nothing from the rest of ``pipeline``. The implementations keep their own registries (the loss functions
by name, the readers, the backbones, the presets, the probes) and ``tests/config/test_registries.py`` checks that
each matches its list here. Import from the submodules (this file exports nothing, so it adds nothing to a
stage's deps).
"""
