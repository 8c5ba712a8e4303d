"""
---
title: The glossary
summary: Each term, what it means in one line, and a link to the note that defines it.
---

# The glossary

The terms and their one-line meanings are listed in `docs_src/glossary.txt`
(`term: meaning`). The place that defines a term is marked in the notes with
`{{term: the term}}`; the glossary links each term there. A term defined on two
pages stops the build: a term has one definition.

Each term is a row of its own, beside the first lines of the code that its
defining note sits beside (the `def` or `class` line and its signature), so a
reader sees the term, its meaning and the code that does it. Where the
definition sits beside no code (a page's opening), the glossary line names the
code that does it: `term: meaning | code: path.py:Name` (`Name` a function, a
class or `Class.method`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError, rel_href, slugify
from .snippets import code_of, head
from .split import Section

GLOSSARY_FILE = "docs_src/glossary.txt"

# What the page says to its reader (the docstring above is for the builder's).
READER_INTRO = (
    "Each term of the notes, what it means in one line, and the page that "
    "defines it: the link lands on the sentence that defines the term. Beside "
    "each term, the first lines of the code its definition sits beside. Under the "
    "terms, the notation: every symbol of the formulas, one meaning each.")

# lines of the defining code shown beside a term: enough for a decorator, the
# `def` line and a signature wrapped over a few lines
CODE_LINES = 6


@dataclass(frozen=True)
class Definition:
    term: str
    page: str  # site-relative page that defines it
    page_title: str
    file: str = ""  # repository-relative file of the code beside the definition
    code: str = ""  # the first lines of that code ("" where the note has none)
    lineno: int = 0


CODE_MARK = " | code: "


def _entries(root: Path) -> list[tuple[str, str, str, str]]:
    """(slug, term, meaning, code name) of each line of the glossary file."""
    path = root / GLOSSARY_FILE
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        line, _, code = line.partition(CODE_MARK)
        term, sep, meaning = line.partition(": ")
        if not sep or (CODE_MARK.strip() in line) or (code and ":" not in code):
            raise BuildError(f"{GLOSSARY_FILE}:{n}: write 'term: meaning' or "
                             "'term: meaning | code: path.py:Name'")
        out.append((slugify(term), term.strip(), meaning.strip(), code.strip()))
    return out


def read_meanings(root: Path) -> dict[str, tuple[str, str]]:
    """slug -> (term, meaning) from the glossary file, in the file's order."""
    return {slug: (term, meaning) for slug, term, meaning, _ in _entries(root)}


def read_code_names(root: Path) -> dict[str, tuple[str, str]]:
    """slug -> (file, name) of the code a term's line names, where it names one."""
    return {slug: tuple(code.split(":", 1)) for slug, _, _, code in _entries(root)
            if code}


def add_definition(defs: dict[str, Definition], slug: str, d: Definition) -> None:
    old = defs.get(slug)
    if old is not None and old.page != d.page:
        raise BuildError(f"term {d.term!r} is defined on {old.page} and on {d.page}; "
                         "a term has one definition")
    defs.setdefault(slug, d)


def _order(meanings: dict[str, tuple[str, str]],
           defs: dict[str, Definition]) -> list[str]:
    slugs = list(meanings) + sorted(s for s in defs if s not in meanings)
    return sorted(slugs, key=lambda s: (meanings.get(s, (defs[s].term if s in defs
                                                         else s,))[0].lower()))


def _named_code(root: Path, file: str, name: str):
    """The code a glossary line names; none where the tree built lacks it (a
    test's tree of a few files: `tests/docs/test_generated_beside_code.py`
    checks that the repository has every name)."""
    try:
        return code_of(root, file, name)
    except BuildError:
        return None


def glossary_rows(root: Path, meanings: dict[str, tuple[str, str]],
                  defs: dict[str, Definition], page: str
                  ) -> list[tuple[Section, str]]:
    """The glossary's rows after its opening: (row, file of its code), one per
    term, the code that of the note defining the term, or else the code its
    glossary line names."""
    named = read_code_names(root)
    rows = []
    for slug in _order(meanings, defs):
        term, meaning = meanings.get(slug, (defs[slug].term if slug in defs else slug,
                                            ""))
        d = defs.get(slug)
        where = (f"Defined on [{d.page_title}]({rel_href(d.page, page)}#term-{slug})."
                 if d else "Not marked yet.")
        doc = (f'<span id="glossary-{slug}"></span>**{term}**: '
               f"{meaning}{'.' if meaning else ''} {where}")
        if d and d.code:
            rows.append((Section(doc, head(d.code, CODE_LINES), d.lineno), d.file))
        elif slug in named and (snippet := _named_code(root, *named[slug])):
            rows.append((Section(doc, head(snippet.code, CODE_LINES),
                                 snippet.lineno), snippet.file))
        else:
            rows.append((Section(doc, "", 0), ""))
    return rows
