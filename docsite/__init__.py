"""
---
title: The notes site builder
summary: How the notes site is made from labml_zero's modules.
---

# The notes site builder

Every module of `labml_zero/` is a two-column page: notes on the left, the code
they explain on the right. The builder is this package, run by
`python build_docs.py`; its files, in the order a build uses them:

1. `paths.py`: where each page lives, relative links, `BuildError`.
2. `split.py`: a `.py` file -> rows of (notes, code).
3. `order.py`: the one reading order (`docs_src/reading_order.txt`).
4. `results.py`: the Results page from `bench/results/*.jsonl`.
5. `directives.py`: `{{py: …}}`, `{{bench: …}}`, `{{term: …}}`, `{{see: …}}`;
   `citations.py`: `(tested: …)` as a check mark after its sentence, linking to
   the test's line on the source pages of `tests/`.
6. `mathml.py`: TeX -> MathML, and what stops the build.
7. `markdown.py`: notes -> HTML, links, note anchors, figures, code highlighting.
8. `glossary.py`: the glossary page; `snippets.py`: the lines of code set
   beside the glossary's terms and the Results page's columns.
9. `site.py`: every page into the template, deterministically.
10. `cli.py`: writing `site/` and `--check`.
11. `lint.py`: the checks of the notes' text that the tests run (raw TeX,
    introduction length, lab traces, unchecked numbers) with their allowlists;
12. `terms.py`: the check that no page uses a term before its definition;
13. `code_index.py` and `code_refs.py`: the checks that every name, flag and
    file a note quotes exists in the code, and that no note restates a constant.
14. `notation.py`: the notation table (`docs_src/notation.txt`) on the glossary
    page, and the check that no page gives a listed symbol another meaning.
15. `notes_beside_code.py`: how many note words sit in rows with no code beside
    them, and code rows with no note.
16. `references.py`: the first mention of a cited paper or project on a page
    links to it.
"""

from .cli import main, stale_files, write_site
from .markdown import Renderer, highlight, link_code_notes, source_html
from .paths import (BuildError, discover_modules, module_page, rel_href, slugify,
                    source_page)
from .site import Page, _load_path, build_figures, build_site, load_module_page
from .split import Section, SplitModule, parse_front_matter, split_source

__all__ = [
    "BuildError", "Page", "Renderer", "Section", "SplitModule", "_load_path",
    "build_figures", "build_site", "discover_modules", "highlight",
    "link_code_notes", "load_module_page", "main", "module_page",
    "parse_front_matter", "rel_href", "slugify", "source_html", "source_page",
    "split_source", "stale_files", "write_site",
]
