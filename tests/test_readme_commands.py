"""The README's install and test commands are the ones CI runs (`.ci/run`), character for character.

A newcomer follows the README; CI proves the project with `.ci/run`. When the two differ, CI passes on an
environment no newcomer gets (an unpinned install resolved pytest 9.2, whose `approx` broke a test CI never saw).
"""

from __future__ import annotations

import re
import shlex

from tests.conftest import ROOT


def ci_commands(text: str) -> dict[str, str]:
    """``{"install": ..., "test": ...}``: the pip install and pytest lines of a CI script."""
    found = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:4] == ["python", "-m", "pip", "install"]:
            found["install"] = shlex.join(words)
        elif words[:3] == ["python", "-m", "pytest"]:
            found["test"] = shlex.join(words)
    return found


def quick_start(readme: str) -> list[str]:
    """The commands of the README's Quick start block, comments stripped, normalised as the shell reads them."""
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README.md has a `## Quick start` section with a bash block"
    out = []
    for line in block.group(1).splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def test_readme_install_and_test_lines_are_what_ci_runs():
    ci = ci_commands((ROOT / ".ci/run").read_text())
    assert set(ci) == {"install", "test"}, ci
    assert "-c deploy/constraints.txt" in ci["install"]  # the tested versions, for CI and newcomers alike
    readme = quick_start((ROOT / "README.md").read_text())
    assert ci["install"] in readme, f"README's Quick start installs otherwise than CI ({ci['install']})"
    assert ci["test"] in readme, f"README's Quick start tests otherwise than CI ({ci['test']})"
