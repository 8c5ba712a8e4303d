"""
---
title: The glossary
summary: Each term, what it means in one line, and a link to the note that defines it.
---

# The glossary

The terms and their one-line meanings are listed in `docs_src/glossary.txt`
(`term: meaning`). The place that defines a term is marked in the notes with
`{{term: the term}}`; the glossary links each term there and sets it beside the
first lines of the code that note sits beside, so the term, its meaning and the
code that does it are read together. A term defined on two pages stops the
build: a term has one definition.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError, rel_href, slugify
from .notation import Symbol
from .split import Section

GLOSSARY_FILE = "docs_src/glossary.txt"

# What the page says to its reader (the docstring above is for the builder's).
READER_INTRO = (
    "Each term of the notes, what it means in one line, and the page that "
    "defines it: the link lands on the sentence that defines the term. Under the "
    "terms, the notation: every symbol of the formulas, one meaning each.")


@dataclass(frozen=True)
class Definition:
    term: str
    page: str  # site-relative page that defines it
    page_title: str
    code: str = ""
    """the code the defining note sits beside ("" for a note beside none)"""
    lineno: int = 0
    source: str | None = None
    """the module that code is in"""


EXCERPT_LINES = 8
"""code lines shown beside a term: its definition's `def` or `class` line and
what follows, enough to recognise it; the link leads to the rest"""


def read_meanings(root: Path) -> dict[str, tuple[str, str, str]]:
    """slug -> (term, meaning, code pointer or "") from the glossary file, in the
    file's order; a pointer that names no code stops the build."""
    path = root / GLOSSARY_FILE
    out: dict[str, tuple[str, str]] = {}
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        term, sep, meaning = line.partition(": ")
        if not sep:
            raise BuildError(f"{GLOSSARY_FILE}:{n}: write 'term: meaning'")
        meaning, _, code = meaning.partition(" @ ")
        if code:
            try:
                quote_code(root, code.strip())
            except BuildError as e:
                raise BuildError(f"{GLOSSARY_FILE}:{n}: {e}") from None
        out[slugify(term)] = (term.strip(), meaning.strip(), code.strip())
    return out


def quote_code(root: Path, pointer: str) -> tuple[str, int, str]:
    """`(code, first line, file)` that a glossary line's `@ file:name` names.

    `name` is a module-level `def`, `class` or assignment, or `Class.method`;
    or, in backticks, the first line that contains that text (a workload's
    entry in a table of workloads). The quote runs from that line, the docstring
    left out, for at most `EXCERPT_LINES` lines, ending where its brackets
    close."""
    rel, sep, name = pointer.partition(":")
    path = root / rel
    if not sep or not path.is_file():
        raise BuildError(f"no file {rel!r} to quote (write '@ file.py:name')")
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if name.startswith("`"):
        found = [i + 1 for i, line in enumerate(lines) if name.strip("`") in line]
        if not found:
            raise BuildError(f"{rel} has no line with {name}")
        start, skip = found[0], set()
    else:
        node = _named(ast.parse(text), name.split("."))
        if node is None:
            raise BuildError(f"{rel} defines no {name!r}")
        start = min([node.lineno] + [d.lineno for d in
                                     getattr(node, "decorator_list", [])])
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)):
            lines = lines[:node.end_lineno]  # an assignment: itself only
        skip = set()
        body = getattr(node, "body", [])
        if (body and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)):
            skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    quoted, depth = [], 0
    for number in range(start, len(lines) + 1):
        if number in skip:
            continue
        line = lines[number - 1]
        quoted.append(line)
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if len(quoted) >= EXCERPT_LINES or (name.startswith("`") and depth <= 0):
            break
    return textwrap.dedent("\n".join(quoted)).rstrip(), start, rel


def _named(tree: ast.AST, path: list[str]) -> ast.AST | None:
    for node in getattr(tree, "body", []):
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                   ast.AsyncFunctionDef))
                 else [t.id for t in getattr(node, "targets", [])
                       if isinstance(t, ast.Name)]
                 + ([node.target.id] if isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name) else []))
        if path[0] in names:
            return node if len(path) == 1 else _named(node, path[1:])
    return None


def add_definition(defs: dict[str, Definition], slug: str, d: Definition) -> None:
    old = defs.get(slug)
    if old is not None and old.page != d.page:
        raise BuildError(f"term {d.term!r} is defined on {old.page} and on {d.page}; "
                         "a term has one definition")
    defs.setdefault(slug, d)


def excerpt(code: str) -> str:
    """The first `EXCERPT_LINES` lines of a note's code, dedented, without the
    blank lines a section starts or ends with."""
    lines = textwrap.dedent(code.strip("\n")).splitlines()
    return "\n".join(lines[:EXCERPT_LINES]).rstrip()


def glossary_sections(root: Path, meanings: dict[str, tuple[str, str, str]],
                      defs: dict[str, Definition], page: str,
                      symbols: list[Symbol]) -> list[Section]:
    """The page as rows: its opening, one row per term beside its code (the code
    its glossary line points to, else the code its defining note sits beside),
    and the notation last, each symbol beside the code that holds it."""
    slugs = list(meanings) + sorted(s for s in defs if s not in meanings)
    slugs.sort(key=lambda s: (meanings.get(s, (defs[s].term if s in defs else s,))[0]
                              .lower()))
    sections = [Section("# Glossary\n\n" + READER_INTRO, "", 0)]
    for slug in slugs:
        term, meaning, pointer = meanings.get(
            slug, (defs[slug].term if slug in defs else slug, "", ""))
        d = defs.get(slug)
        where = (f"Defined on [{d.page_title}]({rel_href(d.page, page)}#term-{slug})."
                 if d else "Not marked yet.")
        doc = (f'<span id="glossary-{slug}"></span>**{term}**: {meaning}.'
               f" {where}")
        if pointer:
            sections.append(Section(doc, *quote_code(root, pointer)))
        elif d and d.code.strip():
            blank = len(d.code) - len(d.code.lstrip("\n"))  # lines excerpt drops
            sections.append(Section(doc, excerpt(d.code), d.lineno + blank, d.source))
        else:
            sections.append(Section(doc, "", 0))
    sections.append(Section(
        "## Notation\n\nOne symbol per quantity across the book: no page gives a "
        "symbol of this list another meaning.", "", 0))
    for symbol in symbols:
        doc = f"${symbol.tex}$: {symbol.meaning}."
        sections.append(Section(doc, *quote_code(root, symbol.code))
                        if symbol.code else Section(doc, "", 0))
    return sections
