"""
---
title: Citations of tests
summary: A tested number's proof as a quiet mark after its sentence, linking to the test's code.
---

# Citations of tests

A note writes `(tested: tests/zero3/test_chunk.py::test_gather)` right after a
number (or a formula) to say which test asserts it; the number lint
(`docsite/lint.py`) reads that source as it is. On the page the tag would sit
between a number and its unit ("costs 18 (tested by …) bytes"), so the builder
takes it out of the sentence and shows it as a small check mark **after the
sentence**: after the next `.`, `;`, `:`, `!` or `?` that is followed by a space
(formulas, code and links are skipped over whole, "e.g." is not an end), or,
when the paragraph, list item or table cell ends first, at its end. Several tags
of one sentence become one group of marks, one per distinct test.

Each mark links to the test function's line on the test file's source page
(`source/tests/…/test_x.py.html#L42`: every file under `tests/` is rendered
like the modules' source pages, outside the reading order), and its hover title
names the test (with its docstring's first line, if it has one). A tag naming a file or a test function that does not exist stops
the build.
"""

from __future__ import annotations

import ast
import html
import re
from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError, rel_href, source_page

TESTED = re.compile(r"\(tested:\s*(tests/[\w/.-]+\.py)::(\w+)\)")
"""The source syntax of a citation: the test file and its test function."""

# What a sentence end never falls inside: fenced code, code spans, display and
# inline math, links' targets, HTML tags and other directives.
_SKIP = re.compile(
    r"^(```|~~~).*?^\1[ \t]*$|`+[^`]*`+|\$\$.*?\$\$|\$[^$\n]+\$"
    r"|\]\([^)\s]*\)|<[^>\n]+>|\{\{.*?\}\}", re.S | re.M)
_END = re.compile(r"[.;:!?](?=\s|$)|\n[ \t]*\n|\n(?=[ \t]*(?:[-+*>#|]\s|\d+[.)]\s))"
                  r"|\|")
_NOT_AN_END = re.compile(r"\b(?:e\.g|i\.e|cf|vs|etc|approx)\.$")


@dataclass(frozen=True)
class Citation:
    path: str  # tests/…/test_x.py
    test: str  # the test function's name
    line: int  # its `def` line
    says: str = ""  # the first line of its docstring, if it has one


class TestIndex:
    """The test functions of `root/tests`, by file: name -> `def` line."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, dict[str, int]] = {}

    def lookup(self, path: str, test: str, where: str) -> Citation:
        if path not in self.files:
            file = self.root / path
            if not file.is_file():
                raise BuildError(f"{where}: (tested: {path}::{test}): no such file")
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=path)
            defs: dict[str, tuple[int, str]] = {}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                    defs.setdefault(node.name, (node.lineno, doc))
            self.files[path] = defs
        found = self.files[path].get(test)
        if found is None:
            raise BuildError(f"{where}: (tested: {path}::{test}): no such test "
                             f"function in {path}")
        return Citation(path, test, *found)


def test_files(root: Path) -> list[str]:
    """Every `.py` file under `tests/`, each rendered as a source page."""
    tests = root / "tests"
    if not tests.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in tests.rglob("*.py")
                  if "__pycache__" not in p.parts)


def mark_html(citations: list[Citation], page: str) -> str:
    """One group of check marks, one link per distinct test."""
    links = []
    for c in dict.fromkeys(citations):
        href = html.escape(f"{rel_href(source_page(c.path), page)}#L{c.line}")
        title = f"asserted by {c.path}::{c.test}"
        title = html.escape(f"{title}: {c.says}" if c.says else title)
        links.append(f'<a href="{href}" title="{title}" aria-label="{title}">✓</a>')
    return f'<sup class="tested">{"".join(links)}</sup>'


def _sentence_end(text: str, start: int) -> int:
    """Where the mark of a tag taken out at `start` goes: after its sentence."""
    line_start = text.rfind("\n", 0, start) + 1
    if re.match(r"[ \t]*#{1,6}[ \t]", text[line_start:]):  # a heading ends at its line
        line_end = text.find("\n", start)
        return len(text[:line_end if line_end >= 0 else len(text)].rstrip())
    pos = start
    while True:
        skip = _SKIP.search(text, pos)
        stop = skip.start() if skip else len(text)
        for end in _END.finditer(text, pos, stop):
            if end.group(0) == "." and _NOT_AN_END.search(text, 0, end.end()):
                continue
            if end.group(0) in ".;:!?":
                return end.end()
            return len(text[:end.start()].rstrip())
        if skip is None:
            return len(text.rstrip())
        pos = skip.end()


def place_citations(text: str, page: str, index: TestIndex) -> str:
    """A note's Markdown with each `(tested: …)` moved after its sentence as a mark."""
    tags = [m for m in TESTED.finditer(text) if not _inside_code(text, m.start())]
    if not tags:
        return text
    # Take each tag out with the spaces before it ("18 (tested: …) bytes" reads
    # "18 bytes"), noting where in the text without tags it was.
    bare, taken, last = [], [], 0
    for m in tags:
        head = text[last:m.start()]
        bare.append(head if head.endswith("\n\n") else head.rstrip(" \t\n"))
        if bare[-1] != head and text[m.end():m.end() + 1].isalnum():
            bare.append(" ")
        taken.append((sum(map(len, bare)),
                      index.lookup(m.group(1), m.group(2), page)))
        last = m.end()
    bare.append(text[last:])
    plain = "".join(bare)
    groups: dict[int, list[Citation]] = {}
    for at, citation in taken:
        groups.setdefault(_sentence_end(plain, at), []).append(citation)
    out, last = [], 0
    for at in sorted(groups):
        # A mark may not follow a display formula's closing `$$` on its line.
        sep = "\n" if plain[:at].endswith("$$") else ""
        out += [plain[last:at], sep, mark_html(groups[at], page)]
        last = at
    out.append(plain[last:])
    return "".join(out)


def _inside_code(text: str, pos: int) -> bool:
    """Is `pos` inside code (a tag shown as an example is not a citation)?"""
    for m in re.finditer(r"^(```|~~~).*?^\1[ \t]*$|`+[^`]*`+", text, re.S | re.M):
        if m.start() <= pos < m.end():
            return True
    return False
