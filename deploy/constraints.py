"""Write ``deploy/constraints.txt``: the exact version of every package the project installs, as tested.

``pyproject.toml`` gives ranges (what the project works with); a cluster needs one version of each on every node,
the ones the tests ran with: a worker that boots a week after the head must not get a newer Ray (Ray refuses a
version mismatch between nodes) or a newer torch. CI installs with ``-c deploy/constraints.txt`` (``.ci/run``), so
the tests run exactly these versions, and the cluster recipes install with the same file.

The pins are the installed dependency closure of ``transfusion-pipeline[dev]`` (every requirement, followed
through its extras and environment markers), read with :mod:`importlib.metadata`; nothing else of the environment.
Regenerate after a dependency change, in an environment that passed the tests::

    python deploy/constraints.py            # rewrites deploy/constraints.txt
    python deploy/constraints.py --check    # exit 1 and the differences when the file is out of date
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "transfusion-pipeline"
EXTRAS = ("dev",)
FILE = Path(__file__).with_name("constraints.txt")
HEADER = ("# The exact versions the tests ran with (python deploy/constraints.py writes this file from a tested\n"
          "# environment). CI and every cluster node install with:\n"
          "#   python -m pip install -c deploy/constraints.txt -e .\n")


def closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """``{canonical name: installed version}`` of every installed package ``project[extras]`` requires, directly
    or through other packages (their extras and markers evaluated for this interpreter); ``project`` itself is left
    out. A requirement that is not installed (a marker for another platform) is skipped."""
    extras_of: dict[str, frozenset[str]] = {}
    versions: dict[str, str] = {}
    todo = [(project, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in extras_of and wanted <= extras_of[key]:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        extras_of[key] = extras_of.get(key, frozenset()) | wanted
        versions[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras_of[key] or {""})):
                todo.append((req.name, frozenset(req.extras)))
    versions.pop(canonicalize_name(project), None)
    return dict(sorted(versions.items()))


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def read(path: Path = FILE) -> dict[str, str]:
    """The pins of a constraints file: ``{canonical name: version}``."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def main(argv: list[str]) -> int:
    pins = closure()
    if "--check" in argv:
        pinned = read()
        diff = sorted(f"{k}: pinned {pinned.get(k, '-')}, installed {pins.get(k, '-')}"
                      for k in set(pins) | set(pinned) if pins.get(k) != pinned.get(k))
        print("\n".join(diff) or f"{FILE.name} matches this environment ({len(pins)} packages)")
        return 1 if diff else 0
    FILE.write_text(render(pins))
    print(f"wrote {FILE} ({len(pins)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
