"""README.md and docs/*.md describe the product and its measured behaviour; how it was developed belongs in git.

A newcomer has no context for "an earlier session", "issue 11" or "the defects it fixed": such references fail here,
naming the file and line. Ray's own log directories (``/tmp/ray/session_*``, ``session_latest``) are product facts
and stay. Pure text work: no imports of the project.
"""

from __future__ import annotations

import re

from tests.test_docs_links import ROOT, markdown_files

# (what it is, pattern); case-insensitive
HISTORY = [
    ("a work session", r"(?<!\bRay )\bsessions?\b(?![_*])(?!-scoped)"),  # not Ray's sessions, session_* dirs
    ("an issue or pull request number", r"\b(?:issues?|tickets?|bugs?|PRs?|pull requests?)\s*#?\d+"),
    ("a GitHub reference", r"(?<![\w/&#])#\d+\b"),
    ("a defect history", r"\bdefects? (?:it|we|they|this \w+) (?:fixed|found)\b|\bwhat (?:each|the) defects? became\b"
                         r"|\bdefects? found\b"),
    ("an earlier state of the code or machine",
     r"\b(?:an?|the|that) (?:earlier|previous|prior|former|older) (?:session|machine|run|version|code|"
     r"implementation|commit)s?\b"),
    ("a change narrative", r"\b(?:before|after) (?:the|this|that) (?:fix|change|rewrite|refactor)\b|\bwith the change\b"
                           r"|\b(?:fixes|changes) the benchmarks drove\b|\bwas first verified\b"),
]


def history_references(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the matched text) of every history reference in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in HISTORY:
            found += [(number, what, m.group(0)) for m in re.finditer(pattern, line, flags=re.IGNORECASE)]
    return found


def test_readme_and_docs_have_no_development_history():
    files = markdown_files()
    assert len(files) > 5
    hits = [f"{f.relative_to(ROOT)}:{n}: {what} ({matched!r})" for f in files
            for n, what, matched in history_references(f.read_text())]
    assert hits == [], ("describe the product, keep measured numbers with their command and machine, leave the "
                        "history to git: " + "; ".join(hits))
