"""The ground floor: ``params.yaml`` validated into typed configs, one module per section (``data``, ``model``,
``loss``, ``augment``, ``train``, ``probe``, ``ray``, ``sweep``, ``theory``, ``tables``) and ``params`` for the
whole file. Each section's allowed names are plain literals here, so that a stage depends only on the sections it
reads: ``prepare`` reads ``base`` and ``data``, and a new loss name never re-runs it.

Imports nothing from the rest of ``pipeline`` (the implementations import their names from here, and
``tests/test_config.py`` checks that each registry matches its list). Import from the submodules.
"""
