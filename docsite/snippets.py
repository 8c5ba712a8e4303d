r"""
---
title: Code beside a generated page's notes
summary: The lines of one function or class of any file, to set beside a note that is not in that file.
---

# Code beside a generated page's notes

The glossary and the Results page are built, not written beside code; their
notes are about code elsewhere (the note that defines a term, the function that
computes a column). `code_of(root, file, name)` finds that code by name, so a
generated row shows the lines it explains and links to them, and a renamed
function stops the build instead of showing stale lines. A file absent from
the tree built (a test builds a few files of the repository) gives no code: the
row sits beside none.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError


@dataclass(frozen=True)
class Snippet:
    file: str  # repository-relative path of the code
    code: str
    lineno: int  # 1-based line of the first line shown


def code_of(root: Path, file: str, name: str, max_lines: int = 0,
            start: str = "") -> Snippet | None:
    """
    The source of `name` (`f`, `Class` or `Class.method`) in `file`, decorators
    included, or from its first line that contains `start` when that is given;
    at most `max_lines` lines when that is positive; `None` when the tree has
    no `file`.
    """
    path = root / file
    if not path.is_file():
        return None
    source = path.read_text(encoding="utf-8")
    body = ast.parse(source).body
    node = None
    for part in name.split("."):
        node = next((n for n in body if isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part), None)
        if node is None:
            raise BuildError(f"{file}: no function or class {name!r}")
        body = node.body
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = source.splitlines()[first - 1:node.end_lineno]
    if start:
        at = next((n for n, line in enumerate(lines) if start in line), None)
        if at is None:
            raise BuildError(f"{file}: {name!r} has no line with {start!r}")
        lines, first = lines[at:], first + at
    if max_lines > 0:
        lines = lines[:max_lines]
    return Snippet(file, "\n".join(lines), first)


def head(code: str, max_lines: int) -> str:
    """The first lines of a block of code, up to the end of its first `def` or
    `class` line (its signature) when that comes within `max_lines`."""
    lines = code.splitlines()
    for n, line in enumerate(lines[:max_lines]):
        if line.lstrip().startswith(("def ", "class ", "async def ")):
            for m in range(n, min(len(lines), max_lines)):
                if lines[m].rstrip().endswith(":"):
                    return "\n".join(lines[:m + 1])
    return "\n".join(lines[:max_lines])
