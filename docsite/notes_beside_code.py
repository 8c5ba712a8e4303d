r"""
---
title: Notes beside their code
summary: How many note words sit in rows with no code beside them, page by page.
---

# Notes beside their code

A page teaches best when each explanation sits beside the lines it is about.
This check reads the rows that `split.py` makes of every module page and counts,
per page, the note words in rows with no code beside them (the introduction, a
closing `## Limitations`, a comment block with nothing under it) against all the
page's note words. Over the whole site

$$\text{share} = \frac{\sum_\text{pages} \text{words in rows without code}}
{\sum_\text{pages} \text{note words}} \le \texttt{MAX\_SHARE}$$

and no page may hold more than `MAX_PAGE_WORDS` words in such rows.

It also lists the converse, code with no note beside it: a code row whose note is
empty, or only points elsewhere ("see Note: …"), shows the reader nothing but the
row's § mark. Such a row is fine beside imports (and `__all__`) and nowhere
else.

Words are counted as the introduction budget counts them (`prose.intro_words`),
with each formula one word, a `code` span the names it shows (`hf_prefix(layer)`
is two), each directive the words it shows and `(tested: …)` none: what a reader
reads on the rendered page.

`python -m docsite.notes_beside_code` prints the report; `--all` lists every
page; `tests/docs/test_notes_beside_code.py` asserts the limits.
"""

from __future__ import annotations

import ast
import html
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import order
from .directives import BENCH, PY, SEE, TERM, TESTED
from .paths import REPO, discover_modules
from .prose import intro_words
from .site import load_pages
from .split import Section

MAX_SHARE = 0.15
MAX_PAGE_WORDS = 600

CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
# "see Note: why storage resize", up to the end of its clause.
SEE_NOTE = re.compile(r"\bsee\s+Note:[^;)\n]*", re.I)


def note_words(markdown: str) -> int:
    """The words a reader reads in one note (see the introduction for the rule)."""
    text = TESTED.sub(" ", markdown)
    text = PY.sub(" n ", BENCH.sub(" n ", text))
    text = TERM.sub(lambda m: f" {m.group(2) or m.group(1)} ", text)
    text = SEE.sub(lambda m: f" {m.group(2) or m.group(1)} ", text)
    text = FENCE.sub(" ", text)
    text = CODE_SPAN.sub(lambda m: " " + re.sub(r"\W+", " ", m.group(0)) + " ",
                         text)
    return intro_words(text)


def has_note(doc: str) -> bool:
    """False for an empty note and for one that only says "see Note: …"."""
    return bool(re.search(r"\w", SEE_NOTE.sub(" ", doc)))


def _exports(node: ast.Assign | ast.AnnAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def _imports_only(body: list[ast.stmt]) -> bool:
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _exports(node):
            continue  # `__all__`, the list of what the imports row exports
        if isinstance(node, ast.If) and _imports_only(node.body) and _imports_only(
                node.orelse):
            continue  # `if TYPE_CHECKING:` imports
        if isinstance(node, ast.Try) and _imports_only(node.body) and all(
                _imports_only(h.body) for h in node.handlers):
            continue  # `try: import x` / `except ImportError:`
        return False
    return True


def is_imports(code: str) -> bool:
    """True when every statement of a code row is an import (or `__all__`)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # a fragment of a block: not a row of imports
        return False
    return bool(tree.body) and _imports_only(tree.body)


@dataclass
class PagePlacement:
    """One page's rows, counted."""

    rel_py: str
    words: int = 0
    words_without_code: int = 0
    """note words in rows with no code beside them"""
    rows_without_code: int = 0
    code_rows: int = 0
    code_without_note: list[int] = field(default_factory=list)
    """first lines of code rows with no note, or only "see Note: …"; imports too"""
    bare_rows: list[int] = field(default_factory=list)
    """those of `code_without_note` that are not imports: a bare § mark"""


CONTENTS_HEADING = "## Pages in this folder"


def measure_page(rel_py: str, sections: list[Section]) -> PagePlacement:
    page = PagePlacement(rel_py)
    for section in sections:
        # A folder's generated list of its pages is a table of contents, not a
        # note: it has no code to sit beside, and is not counted.
        if section.doc.startswith(CONTENTS_HEADING):
            continue
        words = note_words(section.doc)
        page.words += words
        if not section.code.strip():
            page.words_without_code += words
            page.rows_without_code += 1
            continue
        page.code_rows += 1
        if not has_note(section.doc):
            page.code_without_note.append(section.lineno)
            if not is_imports(section.code):
                page.bare_rows.append(section.lineno)
    return page


def measure(root: Path = REPO) -> list[PagePlacement]:
    """Every module page in the reading order (the home, results and glossary
    pages are prose, not notes beside code, and are not counted)."""
    modules = discover_modules(root)
    parts = order.load_order(root, modules)
    pages = load_pages(root, modules, parts, "")
    return [measure_page(p.rel_py, p.sections) for p in pages if p.rel_py]


def share_without_code(pages: list[PagePlacement]) -> float:
    total = sum(p.words for p in pages)
    return sum(p.words_without_code for p in pages) / total if total else 0.0


def over_limit(pages: list[PagePlacement]) -> list[PagePlacement]:
    return [p for p in pages if p.words_without_code > MAX_PAGE_WORDS]


def summary_lines(pages: list[PagePlacement]) -> list[str]:
    """The few lines `python -m docsite.lint` prints too."""
    share = share_without_code(pages)
    longest = max(pages, key=lambda p: p.words_without_code)
    over = over_limit(pages)
    bare = sum(len(p.bare_rows) for p in pages)
    return [
        f"notes_beside_code: {share:.1%} of note words in rows without code "
        f"(limit {MAX_SHARE:.0%}); longest {longest.rel_py} "
        f"{longest.words_without_code} words; {len(over)} pages over "
        f"{MAX_PAGE_WORDS}; {bare} code rows with no note beside non-imports",
        *(f"  over: {p.rel_py} {p.words_without_code}" for p in
          sorted(over, key=lambda p: -p.words_without_code)),
    ]


def main(argv: list[str]) -> int:
    pages = measure(REPO)
    rows = pages if "--all" in argv else sorted(
        (p for p in pages if p.words_without_code > MAX_PAGE_WORDS // 2
         or p.bare_rows), key=lambda p: -p.words_without_code)
    print(f"{'page':48} {'no-code':>7} {'words':>6} {'share':>6}  bare § rows")
    for p in rows:
        share = p.words_without_code / p.words if p.words else 0.0
        bare = " ".join(f"L{n}" for n in p.bare_rows)
        print(f"{p.rel_py:48} {p.words_without_code:7} {p.words:6} {share:6.0%}  "
              f"{bare}")
    print()
    print("\n".join(summary_lines(pages)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ## The rows of the built site
#
# The counts above read the modules; the reader reads the built pages, where the
# glossary, the Results page and every folder's page are pages too. So the
# limits of the book are counted on the built HTML of every page but the home
# page: a row is a `<section class="row">`, beside code when it holds a code
# column. The glossary and the Results page are built as such rows too, each
# term and each column's note beside the code it is about; on a page with no
# code column at all (a prose page) each heading's block and each table row is
# a row of its own. The first row of a page is its *opening*, set full width
# above the two columns. A figure is not notes: a drawing, and the tables a
# reader looks a row up in rather than reads through (the Results page's
# measurements, each row one a note links to, and the glossary's notation
# table, each row one symbol) count no words.

MAX_SITE_SHARE = 0.15
"""of all note words, at most this share in rows beside no code"""
MAX_ROW_WORDS = 200
"""words of any row beside no code, but a page's opening"""
MAX_OPENING_WORDS = 250
"""words of a page's opening, set full width above its two columns"""

SECTION = re.compile(r'<section class="row([^"]*)"[^>]*>(.*?)</section>', re.S)
BLOCK_START = re.compile(r"(?=<h[1-6][ >])|(?=<tr>)")


@dataclass(frozen=True)
class BuiltRow:
    page: str
    index: int
    words: int
    beside_code: bool
    opening: bool


def html_words(fragment: str) -> int:
    """Words a reader reads in rendered notes: a formula is one word, code and
    figures' drawings none but the names a `code` span shows."""
    text = re.sub(r"<math\b.*?</math>", " x ", fragment, flags=re.S)
    for tag in ("svg", "pre", "style", "script", "figure"):
        text = re.sub(rf"<{tag}\b.*?</{tag}>", " ", text, flags=re.S)
    text = re.sub(r'<sup class="tested">.*?</sup>', " ", text, flags=re.S)
    # the calculator is a tool, like a figure, not notes; it ends its row
    text = re.sub(r'<div class="calc".*', " ", text, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return len(re.findall(r"[A-Za-z0-9][\w'’-]*", text))


def built_rows(files: dict[str, bytes]) -> list[BuiltRow]:
    rows = []
    for path, data in sorted(files.items()):
        if (not path.endswith(".html") or path == "index.html"
                or path.startswith("source/")):
            continue
        page = data.decode("utf-8")
        prose = '<main class="prose">' in page
        k = 0
        for match in SECTION.finditer(page):
            body = match.group(2)
            beside_code = '<div class="code">' in body
            doc = body.split('<div class="code">', 1)[0]
            doc = doc.split('<div class="figures">', 1)[0]
            # a figure (a drawing, or the Results page's tables of measured
            # figures) is looked at, not read through: none of it is notes
            doc = re.sub(r"<figure\b.*?</figure>", " ", doc, flags=re.S)
            blocks = BLOCK_START.split(doc) if prose else [doc]
            for block in blocks:
                words = html_words(block)
                if not words:
                    continue
                rows.append(BuiltRow(path, k, words, beside_code, k == 0))
                k += 1
    return rows


def site_share(rows: list[BuiltRow]) -> float:
    total = sum(r.words for r in rows)
    return sum(r.words for r in rows if not r.beside_code) / total if total else 0.0


def rows_over(rows: list[BuiltRow]) -> list[BuiltRow]:
    """Rows beside no code longer than their limit."""
    return [r for r in rows if not r.beside_code and r.words > (
        MAX_OPENING_WORDS if r.opening else MAX_ROW_WORDS)]
