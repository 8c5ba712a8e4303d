"""Notes sit beside the code they explain: at most `MAX_SHARE` of all note words
in rows with no code beside them, at most `MAX_PAGE_WORDS` such words on any
page, and no code row with no note (or only "see Note: …") except imports."""

from __future__ import annotations

from pathlib import Path

import pytest

from docsite import notes_beside_code as nbc
from docsite.split import split_source

REPO = Path(__file__).resolve().parents[2]
PAGES = nbc.measure(REPO)


def test_share_of_words_without_code():
    share = nbc.share_without_code(PAGES)
    assert share <= nbc.MAX_SHARE, "\n".join(nbc.summary_lines(PAGES))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.rel_py)
def test_page_words_without_code(page):
    assert page.words_without_code <= nbc.MAX_PAGE_WORDS, (
        f"{page.rel_py}: {page.words_without_code} note words in rows with no code "
        f"beside them; move each explanation above the lines it explains")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.rel_py)
def test_code_rows_have_notes(page):
    assert not page.bare_rows, (
        f"{page.rel_py}: code rows with no note, or only 'see Note: …', at lines "
        f"{page.bare_rows} (allowed only beside imports)")


def test_the_measure_counts_what_it_is_for():
    source = '''"""
# Title

An intro of six words here.
"""

import os

__all__ = ["f"]


def f():
    """One two three."""
    # see Note: why storage resize
    x = 1
    return x


y = 2

# A closing note of six words.
'''
    page = nbc.measure_page("m.py", split_source(source).sections)
    assert page.words_without_code == 2 + 5 + 6
    assert page.words == 2 + 5 + 6 + 3 + 5
    assert page.bare_rows == [15]  # the row whose note is only "see Note"
    assert page.code_without_note == [7, 15]  # the imports row is fine
    constant = '"""\n# T\n"""\n\nimport os\n\nLIMIT = 3\n'
    page = nbc.measure_page("m.py", split_source(constant).sections)
    assert page.bare_rows == [5]  # imports, then a constant with no note
    assert nbc.note_words("`a b` and $x + y$ {{py: f(1)}} (tested: tests/a.py::t)"
                          ) == 5
    assert nbc.note_words("`hf_prefix(layer)`") == 2
    assert nbc.note_words("{{see: shown words | a term}} ok") == 3
    assert not nbc.has_note("(see Note: a; see Note: b)")
    assert nbc.has_note("The rows regrow here; see Note: why storage resize.")
