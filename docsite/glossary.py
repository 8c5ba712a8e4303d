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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError, rel_href, slugify

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


def read_meanings(root: Path) -> dict[str, tuple[str, str]]:
    """slug -> (term, meaning) from the glossary file, in the file's order."""
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
        out[slugify(term)] = (term.strip(), meaning.strip())
    return out


def add_definition(defs: dict[str, Definition], slug: str, d: Definition) -> None:
    old = defs.get(slug)
    if old is not None and old.page != d.page:
        raise BuildError(f"term {d.term!r} is defined on {old.page} and on {d.page}; "
                         "a term has one definition")
    defs.setdefault(slug, d)


def glossary_markdown(meanings: dict[str, tuple[str, str]],
                      defs: dict[str, Definition], page: str) -> str:
    slugs = list(meanings) + sorted(s for s in defs if s not in meanings)
    slugs.sort(key=lambda s: (meanings.get(s, (defs[s].term if s in defs else s,))[0]
                              .lower()))
    out = [READER_INTRO, "",
           "| term | meaning | defined on |", "| --- | --- | --- |"]
    for slug in slugs:
        term, meaning = meanings.get(slug, (defs[slug].term if slug in defs else slug,
                                            ""))
        d = defs.get(slug)
        where = (f"[{d.page_title}]({rel_href(d.page, page)}#term-{slug})"
                 if d else "not marked yet")
        out.append(f'| <span id="glossary-{slug}">{term}</span> | {meaning} '
                   f"| {where} |")
    return "\n".join(out) + "\n"
