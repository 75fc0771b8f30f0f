"""README.md and docs/*.md: every relative link points at something in the repository, and the README stays short.

A relative link is a Markdown inline link or image, ``[text](path)`` / ``![alt](path)``, or a reference
definition ``[ref]: path``, whose target is not a URL (``http:``, ``https:``, ``mailto:`` or any other scheme) and
not an anchor on the same page (``#...``). Its ``#anchor`` is dropped, it is resolved against the directory of the
file it is in, and it must name an existing file or directory inside the repository. Links inside fenced code
blocks and inline code spans are text, not links. Pure text work: no network, no imports of the project.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") or ![alt](<target with spaces>); text may hold one level of nested brackets
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in ``text``, outside code blocks and code spans."""
    found = []
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1) == fence:
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        line = _CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in _INLINE.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            targets.append(reference.group(1))
        found += [(number, t[1:-1] if t.startswith("<") else t) for t in targets]
    return found


def is_relative(target: str) -> bool:
    return bool(target) and not target.startswith("#") and not _SCHEME.match(target)


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, target in link_targets(path.read_text(encoding="utf-8")):
        if not is_relative(target):
            continue
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        resolved = resolved.resolve()
        inside = resolved == ROOT or ROOT in resolved.parents
        if not inside or not resolved.exists():
            why = "outside the repository" if not inside else "no such file or directory"
            broken.append(f"{path.relative_to(ROOT)}:{number}: ({target}): {why}")
    return broken


def test_relative_links_resolve() -> None:
    files = markdown_files()
    assert (ROOT / "README.md") in files and len(files) > 1
    broken = [b for path in files for b in broken_links(path)]
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it <= {README_MAX_LINES}, the rest in docs/"
