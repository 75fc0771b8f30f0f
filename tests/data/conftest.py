"""Fixtures of the data tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_download(monkeypatch):
    """torchvision's downloads of CIFAR-10, Fashion-MNIST and Omniglot fail the test: the files present are read."""
    import torchvision.datasets.cifar as cifar
    import torchvision.datasets.mnist as mnist
    import torchvision.datasets.omniglot as omniglot

    def no_network(*a, **k):
        raise AssertionError("download attempted although the files are present")

    for module in (cifar, mnist, omniglot):
        monkeypatch.setattr(module, "download_and_extract_archive", no_network)
