"""
---
title: Terms before their definition
summary: No page uses a term before the place that defines it, unless it links there.
---

# Terms before their definition

The notes are read in one order (`docs_src/reading_order.txt`, the home page
first), and a term is defined once, where `{{term: …}}` marks it. This check reads
the notes in that order and lists, as `page | term`, every page that uses a term
before the reader has met its definition:

* any page earlier than the defining page whose notes mention the term, and
* the defining page itself when it mentions the term before the marker.

A term of the glossary's list (`docs_src/glossary.txt`) that no page marks is a
finding too, `docs_src/glossary.txt | term`: the glossary would have nowhere to
link it.

A mention is the term as a whole word or phrase, in any case, with or without a
plural `s` (`shards`, `Gather streams`), in prose: code spans and blocks,
directives, link targets and HTML tags do not count. A word joined to the term's
front by a hyphen, or a hyphen and a digit after it, make another name
(`ZeRO-Offload` is not `offload`, `W2-1` is not `W2`), and the defining page's
headings may name what it defines. The Results page and the glossary are not
read as notes (they are generated), though the Results page defines the
workloads.

A page that must speak of a term early writes `{{see: gather stream}}` (or
`{{see: gather streams | gather stream}}`): the words link to the definition and
carry the glossary's one-line meaning as their hover title. A `{{see: …}}`
introduces the term for the rest of its page, so a later mention there is not a
finding: one link a page, not one a sentence. The lists the builder makes from
titles and summaries (the home page's reading order, a folder's contents) are
navigation and are not read.

## Limitations

* The match is by spelling: the verb "shards" counts as the noun (reword it,
  "splits"), while a synonym or a pronoun for a term is not caught.
* Only glossary terms are checked; a concept the glossary does not list can
  still be used before the page that explains it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import order
from .directives import ANY, SEE, TERM
from .glossary import GLOSSARY_FILE, read_meanings
from .markdown import CODE_PARTS
from .paths import discover_modules, slugify
from .results import load_results, results_markdown
from .site import load_module_page
from .split import parse_front_matter

NOT_NOTES = ("results.html", "glossary.html")
"""Generated pages: they may define terms but are not checked for mentions."""


@dataclass(frozen=True)
class Notes:
    """One page's notes as the reader meets them."""

    name: str  # what a finding names: the module path, or docs_src/index.md
    out: str  # the site-relative page
    text: str  # every note of the page, in order, as Markdown


def _blank(match: re.Match) -> str:
    # keep offsets (and line breaks) so a mention can be compared with a marker
    return re.sub(r"[^\n]", " ", match.group(0))


def without_code(markdown: str) -> str:
    return CODE_PARTS.sub(_blank, markdown)


def prose(markdown: str) -> str:
    """The text a reader reads as words: no code, directives, link targets, tags.

    Offsets are those of `markdown` (removed parts become spaces)."""
    text = without_code(markdown)
    text = ANY.sub(_blank, text)
    text = re.sub(r"(?<=\])\([^)]*\)", _blank, text)
    return re.sub(r"<[^>\n]+>", _blank, text)


def term_pattern(term: str) -> re.Pattern:
    """Whole words, any case, any white space between them, an optional plural s."""
    words = r"\s+".join(re.escape(w) for w in term.split())
    return re.compile(rf"(?<![\w-]){words}s?(?!\w)(?!-\d)", re.I)


def mentions(markdown: str, term: str) -> list[int]:
    """Offsets in `markdown` where its prose mentions `term`."""
    return [m.start() for m in term_pattern(term).finditer(prose(markdown))]


def without_headings(markdown: str) -> str:
    """`markdown` with its headings blanked (they may name what follows)."""
    return re.sub(r"^[ \t]*#{1,6}[ \t].*$", _blank, markdown, flags=re.M)


def definitions(pages: list[Notes], meanings: dict[str, tuple[str, str]]):
    """slug -> (term, index of the defining page, offset of the marker)."""
    out: dict[str, tuple[str, int, int]] = {}
    for i, page in enumerate(pages):
        for m in TERM.finditer(without_code(page.text)):
            slug = slugify(m.group(2) or m.group(1))
            if slug not in out:
                term = meanings.get(slug, (m.group(2) or m.group(1),))[0]
                out[slug] = (term, i, m.start())
    return out


def first_see(markdown: str, slug: str) -> int:
    """Offset of the first `{{see: …}}` of the term `slug`, else the length."""
    for m in SEE.finditer(without_code(markdown)):
        if slugify(m.group(2) or m.group(1)) == slug:
            return m.start()
    return len(markdown)


def findings(pages: list[Notes], meanings: dict[str, tuple[str, str]]) -> list[str]:
    """`page | term` for every use of a term before its definition (see above)."""
    defined = definitions(pages, meanings)
    found = {f"{GLOSSARY_FILE} | {term}" for slug, (term, _) in meanings.items()
             if slug not in defined}
    for slug, (term, where, marker) in defined.items():
        for i, page in enumerate(pages[:where + 1]):
            if page.out in NOT_NOTES:
                continue
            text = page.text[:first_see(page.text, slug)]
            if i == where:
                text = without_headings(text[:marker])
            if mentions(text, term):
                found.add(f"{page.name} | {term}")
    return sorted(found)


def load_notes(root: Path) -> list[Notes]:
    """Every page's own notes in reading order: the home page, the modules, and
    the Results page (which defines the workloads)."""
    _, home = parse_front_matter((root / "docs_src" / "index.md")
                                 .read_text(encoding="utf-8"))
    pages = [Notes("docs_src/index.md", "index.html", home)]
    for entry in order.flat(order.load_order(root, discover_modules(root))):
        if entry == "@results":
            text = results_markdown(load_results(root))
        elif entry == "@glossary":
            text = ""
        else:
            text = "\n\n".join(s.doc for s in load_module_page(root, entry).sections)
        pages.append(Notes(entry, order.page_of(entry), text))
    return pages


def check(root: Path) -> list[str]:
    """The findings of the repository at `root`."""
    return findings(load_notes(root), read_meanings(root))


__all__ = ["Notes", "check", "definitions", "findings", "first_see", "load_notes",
           "mentions", "prose", "term_pattern"]
