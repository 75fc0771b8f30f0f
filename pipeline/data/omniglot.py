"""Omniglot (Lake et al. 2015): 1623 handwritten characters of 50 alphabets, 20 drawings each, read through
torchvision's :class:`~torchvision.datasets.Omniglot` from the extracted folders it downloads::

    <data.root>/omniglot-py/images_background/<Alphabet>/<characterNN>/<id>_<nn>.png   30 alphabets, 964 characters
    <data.root>/omniglot-py/images_evaluation/<Alphabet>/<characterNN>/<id>_<nn>.png   20 alphabets, 659 characters

Each drawing is a 105x105 binary PNG; it is read as grey levels (PIL mode "L": 0 the strokes, 255 the paper) into
uint8 ``(N, 1, 105, 105)``. One class per character: its label is its rank among the part's characters sorted by
``<Alphabet>/<characterNN>`` (torchvision lists folders in ``os.listdir`` order, which differs between file
systems; sorting makes the labels, hence the prepared files and their hashes, the same everywhere), and its name
is that ``<Alphabet>/<characterNN>``. The two parts share no character.

How the pipeline splits them is :mod:`pipeline.data.sources`' business (``data.dataset: omniglot`` and
:func:`~pipeline.data.sources.omniglot_sets_split`); this module reads one part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeline.data.types import DatasetError

OMNIGLOT_FOLDER = "omniglot-py"  # torchvision's Omniglot.folder
OMNIGLOT_PARTS = {True: "images_background", False: "images_evaluation"}  # background -> folder
OMNIGLOT_SIZE = 105  # every drawing is 105x105

_DOWNLOAD_HINT = "set data.download: true to fetch it"


def omniglot_place(root: Path, key: str = "data.root") -> str:
    """Where the Omniglot files go under ``root`` (the param ``key``, ``data.root`` by default), for the messages
    about missing files."""
    return (f"place the extracted '{OMNIGLOT_PARTS[True]}' and '{OMNIGLOT_PARTS[False]}' folders "
            f"(<Alphabet>/<characterNN>/*.png) under {root / OMNIGLOT_FOLDER} ({key} is {root})")


def omniglot_counts(root: Path, key: str = "data.root", fix: str | None = None) -> dict[bool, np.ndarray]:
    """The drawings per character of both parts under ``root`` (the param ``key``), from the folder listing alone
    (no drawing is opened: a check before any work): {background: (C,) int64 in label order}, listed as
    :func:`read_omniglot` lists them.

    Raises :class:`DatasetError` naming ``key``, the folder and the layout expected, then ``fix`` (default: fetch it
    with ``data.download`` or place the folders), for a missing root or part, a part without a character folder and
    a character folder without a ``.png``.
    """
    from torchvision.datasets.utils import list_dir, list_files

    root = Path(root)
    fix = fix or f"{_DOWNLOAD_HINT}, or {omniglot_place(root, key)}"
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise DatasetError(f"{key}: {root} {what}; {fix}")
    counts = {}
    for background, part in OMNIGLOT_PARTS.items():
        target = root / OMNIGLOT_FOLDER / part
        if not target.is_dir():
            what = "is not a directory" if target.exists() else "is missing"
            raise DatasetError(f"{key}: Omniglot folder {target} {what}; {fix}")
        try:
            characters = [f"{a}/{c}" for a in sorted(list_dir(str(target))) for c in sorted(list_dir(f"{target}/{a}"))]
            n = np.array([len(list_files(f"{target}/{c}", ".png")) for c in characters], dtype=np.int64)  # (C,)
        except OSError as e:  # unreadable folder
            raise DatasetError(f"{key}: Omniglot folder {target} cannot be listed ({e}); {fix}") from e
        if not characters:
            raise DatasetError(f"{key}: Omniglot folder {target} holds no <Alphabet>/<characterNN> folder; {fix}")
        empty = [c for c, k in zip(characters, n, strict=True) if not k]
        if empty:
            raise DatasetError(f"{key}: Omniglot folder {target} has character folder(s) without a .png: "
                               f"{', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}; {fix}")
        counts[background] = n
    return counts


def _make_omniglot_class():
    from torchvision.datasets import Omniglot
    from torchvision.datasets.utils import list_dir, list_files

    class _FolderOmniglot(Omniglot):
        """torchvision's Omniglot reading the extracted folder: the md5 check of the downloaded zip (which a user
        who extracted the files elsewhere does not have) is replaced by a check that the part's folder holds
        alphabets, and alphabets, characters and drawings are taken in sorted order.

        The download path is torchvision's own: it verifies the zip's md5, and ``zipfile`` extracts it (member
        names with ``..`` or an absolute path are rewritten to stay under the folder).
        """

        _downloading = False

        def __init__(self, root: str, background: bool, download: bool) -> None:
            super().__init__(root, background=background, download=download)
            target = self.target_folder
            self._alphabets = sorted(list_dir(target))
            self._characters = [f"{a}/{c}" for a in self._alphabets for c in sorted(list_dir(f"{target}/{a}"))]
            self._character_images = [
                [(image, label) for image in sorted(list_files(f"{target}/{character}", ".png"))]
                for label, character in enumerate(self._characters)
            ]
            self._flat_character_images = [pair for images in self._character_images for pair in images]
            self.character_names = tuple(self._characters)
            empty = [c for c, images in zip(self._characters, self._character_images, strict=True) if not images]
            if not self._characters or empty:
                what = (f"has character folder(s) without a .png: {', '.join(empty[:3])}" if empty
                        else "holds no <Alphabet>/<characterNN> folder")
                raise DatasetError(f"Omniglot folder {target} {what}; re-extract {self._get_target_folder()}.zip")

        def _check_integrity(self) -> bool:
            target = Path(self.root) / self._get_target_folder()
            if target.is_dir():
                return True
            if self._downloading:  # let torchvision fetch and extract the zip
                return False
            root = Path(self.root).parent  # data.root
            raise DatasetError(f"Omniglot folder {target} is missing; {_DOWNLOAD_HINT}, or {omniglot_place(root)}")

        def download(self) -> None:
            self._downloading = True
            try:
                super().download()
            finally:
                self._downloading = False

        def path(self, index: int) -> str:
            image, label = self._flat_character_images[index]
            return f"{self.target_folder}/{self._characters[label]}/{image}"

    return _FolderOmniglot


def read_omniglot(root: Path, background: bool, download: bool = False) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """One part of Omniglot under ``root`` (``data.root``): the background part (``background``, 964 characters)
    or the evaluation part (659), fetched first by torchvision with ``download`` if it is missing.

    Returns:
        x: uint8 (N, 1, 105, 105) grey levels, the drawings in label order, then file name order.
        y: int64 (N,) in [0, C): the character's rank in sorted ``<Alphabet>/<characterNN>`` order.
        classes: (C,) the ``<Alphabet>/<characterNN>`` names.

    Raises :class:`DatasetError` naming the folder or file, for a missing part, an empty alphabet or character, a
    drawing that does not decode or is not 105x105, and a failed download.
    """
    cls = _make_omniglot_class()
    try:
        ds = cls(str(root), background=background, download=download)
    except DatasetError:
        raise
    except Exception as e:  # download failure (URLError, md5 mismatch) or a file changed under our feet
        raise DatasetError(
            f"could not load Omniglot from {root / OMNIGLOT_FOLDER / OMNIGLOT_PARTS[background]} "
            f"({type(e).__name__}: {e}); check the network if data.download is true, "
            f"or {omniglot_place(root)}"
        ) from e
    size = OMNIGLOT_SIZE
    x = torch.empty((len(ds), 1, size, size), dtype=torch.uint8)  # (N, 1, 105, 105), filled one drawing at a time
    y = torch.empty((len(ds),), dtype=torch.int64)  # (N,)
    for i in range(len(ds)):
        try:
            image, label = ds[i]  # PIL image in mode "L"
        except Exception as e:  # UnidentifiedImageError, truncated file, ...
            raise DatasetError(f"Omniglot drawing {ds.path(i)} cannot be decoded ({e}); re-extract it") from e
        if image.size != (size, size):
            raise DatasetError(f"Omniglot drawing {ds.path(i)} is {image.size[0]}x{image.size[1]}, expected "
                               f"{size}x{size}; re-extract it")
        x[i, 0] = torch.from_numpy(np.array(image, dtype=np.uint8))  # (105, 105)
        y[i] = label
    return x, y, ds.character_names


__all__ = ["OMNIGLOT_FOLDER", "OMNIGLOT_PARTS", "OMNIGLOT_SIZE", "omniglot_counts", "omniglot_place", "read_omniglot"]
