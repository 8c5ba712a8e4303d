"""A docstring that holds TeX is a raw string: in a plain one Python reads
`\\text` as a tab and `ext`, and `\\mu` as an invalid escape, so `help()` and
the code column show a broken formula while the site, built from the source
text, shows it right."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from docsite.paths import discover_modules

REPO = Path(__file__).resolve().parents[2]
TEX_COMMAND = re.compile(r"\\[A-Za-z]{2,}")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def plain_docstrings_with_tex(source: str) -> list[int]:
    """Lines of docstrings written without `r` whose text has a TeX command."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, DOCUMENTED) or not node.body:
            continue
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            continue
        literal = ast.get_source_segment(source, first.value) or ""
        prefix = re.match(r"[rRuU]*", literal).group(0)
        if "r" not in prefix.lower() and TEX_COMMAND.search(literal):
            found.append(first.lineno)
    return found


@pytest.mark.parametrize("rel", discover_modules(REPO))
def test_docstrings_with_tex_are_raw(rel):
    source = (REPO / rel).read_text(encoding="utf-8")
    assert not plain_docstrings_with_tex(source), (
        f"{rel}: docstrings at lines {plain_docstrings_with_tex(source)} hold TeX "
        "but are not raw strings; write r\"\"\"")


def test_the_check_tells_raw_from_plain():
    plain = 'def f():\n    """$\\\\mu$ and $\\\\text{a}$"""\n'
    raw = 'def f():\n    r"""$\\mu$"""\n'
    assert plain_docstrings_with_tex(plain) == [2]
    assert plain_docstrings_with_tex(raw) == []
    assert plain_docstrings_with_tex('"""No TeX \\n here."""\n') == []
