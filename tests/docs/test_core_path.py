"""The core path: the reading order opens with at most six pages that teach the
mechanism, the home page lists them first, and every later page names the core
page it deepens, on the page itself."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from docsite import order, terms  # noqa: E402
from docsite.glossary import read_meanings  # noqa: E402
from docsite.paths import BuildError, discover_modules  # noqa: E402

CORE_PAGES = 6


def repository_order() -> list[order.Part]:
    return order.load_order(REPO, discover_modules(REPO))


def test_the_reading_order_opens_with_a_core_of_at_most_six_pages():
    parts = repository_order()
    core = parts[0]
    assert core.title.startswith("The core path")
    assert 1 <= len(core.entries) <= CORE_PAGES
    assert not set(core.entries) & set(order.GENERATED)
    # the one overview is the core's first page
    assert core.entries[0] == "labml_zero/__init__.py"


def test_every_later_page_names_the_core_page_it_deepens():
    parts = repository_order()
    core = set(parts[0].entries)
    deepened = order.deepens(parts)
    later = [e for part in parts[1:] for e in part.entries
             if e not in order.GENERATED]
    assert [e for e in later if e not in deepened] == []
    assert set(deepened.values()) <= core


def test_a_deepens_line_must_point_into_the_core(tmp_path):
    (tmp_path / "docs_src").mkdir()
    modules = ["labml_zero/__init__.py", "labml_zero/a.py", "labml_zero/b.py"]
    path = tmp_path / "docs_src" / "reading_order.txt"
    path.write_text("## Core\nlabml_zero/__init__.py\n## More\n"
                    "labml_zero/a.py -> labml_zero/__init__.py\n"
                    "labml_zero/b.py -> labml_zero/a.py\n")
    with pytest.raises(BuildError, match=r"labml_zero/b.py -> labml_zero/a.py"):
        order.load_order(tmp_path, modules)
    path.write_text("## Core\nlabml_zero/__init__.py -> labml_zero/__init__.py\n"
                    "## More\nlabml_zero/a.py\nlabml_zero/b.py\n")
    with pytest.raises(BuildError, match="core path"):
        order.load_order(tmp_path, modules)


def test_pages_say_what_they_deepen_and_the_home_page_lists_the_core_first(
        built_site):
    parts = repository_order()
    home = (built_site / "index.html").read_text(encoding="utf-8")
    first = home.index(parts[0].title)
    assert all(home.index(p.title) > first for p in parts[1:] if p.title)
    for entry, core in order.deepens(parts).items():
        page = (built_site / order.page_of(entry)).read_text(encoding="utf-8")
        assert re.search(r"Deepens the core path's <a href=\"[^\"]+\">", page), entry


def core_notes() -> list[terms.Notes]:
    """The home page and the core pages' notes, in reading order."""
    notes = terms.load_notes(REPO)
    return notes[:1 + len(repository_order()[0].entries)]


def test_the_core_path_explains_why_a_chunk_frees_by_resizing_its_storage():
    """The engine's central trick, on the path and not only on the chunk page:
    a paragraph of a core page says that freeing resizes the storage."""
    paragraphs = [p for n in core_notes() for p in re.split(r"\n\s*\n", n.text)]
    assert [p for p in paragraphs if re.search(r"resiz", p)
            and re.search(r"\bstorage\b", p) and "zero bytes" in p]


def test_the_core_path_uses_no_glossary_term_before_the_page_defining_it():
    """The book-wide check (docsite/terms.py), on the core path alone: a core
    page may not lean on a term the reader meets only pages later."""
    assert terms.findings(terms.load_notes(REPO), read_meanings(REPO)) == []
    assert [f for f in terms.findings(core_notes(), read_meanings(REPO))
            if not f.startswith("docs_src/glossary.txt")] == []


NAMES_NOT_IN_THE_GLOSSARY = ("loss scaler", "LocalShard", "DDP")
"""names a core page once used before any page said what they are"""


def introduced(markdown: str, at: int) -> bool:
    """Whether the mention at `at` is a link's words, or an abbreviation in
    parentheses right after what it abbreviates ("data parallelism (DDP)")."""
    before = markdown[:at]
    in_link = before.rfind("[") > before.rfind("]") and re.match(
        r"[^\[\]]*\]\(", markdown[at:])
    return bool(in_link) or (before.endswith("(") and markdown[at:].split(")")[0]
                             .isupper())


def test_the_core_path_introduces_names_the_glossary_does_not_list():
    """The first mention of each such name on the core path links to its page
    or follows what it stands for."""
    for name in NAMES_NOT_IN_THE_GLOSSARY:
        first = next(((n, m[0]) for n in core_notes()
                      for m in [terms.mentions(n.text, name)] if m), None)
        if first is not None:
            notes, at = first
            assert introduced(notes.text, at), (notes.name, name,
                                                notes.text[at - 80:at + 40])


def test_a_mention_is_introduced_by_a_link_or_an_expansion():
    text = "a [loss scaler](s.html); data parallelism (DDP); DDP; a loss scaler"
    assert introduced(text, text.index("loss"))
    assert introduced(text, text.index("DDP"))
    assert not introduced(text, text.rindex("DDP"))
    assert not introduced(text, text.rindex("loss"))
