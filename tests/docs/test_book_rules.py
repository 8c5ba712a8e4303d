"""The book's rules, checked on every built page: rows beside no code within
their limits on the core path, no empty code column anywhere, no builder marker
shown to a reader, every "Note: …" a link, and formulas that the build refuses
when they would render wrongly."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from docsite import notes_beside_code as nbc  # noqa: E402
from docsite import order  # noqa: E402
from docsite.markdown import Renderer  # noqa: E402
from docsite.mathml import to_mathml  # noqa: E402
from docsite.paths import BuildError, discover_modules, module_page  # noqa: E402
from docsite.references import link_references  # noqa: E402

CORE_PATH_WORDS = 10_150
"""the core path's note words when the book's layout rules were set: its budget"""


def core_pages() -> list[str]:
    parts = order.load_order(REPO, discover_modules(REPO))
    return [module_page(e) for e in parts[0].entries]


def pages(site_files: dict[str, bytes]):
    for path, data in site_files.items():
        if path.endswith(".html") and not path.startswith("source/"):
            yield path, data.decode("utf-8")


def test_the_core_path_sets_each_idea_beside_its_code(site_files):
    rows = [r for r in nbc.built_rows(site_files) if r.page in core_pages()]
    assert {r.page for r in rows} == set(core_pages())
    assert not nbc.rows_over(rows), nbc.rows_over(rows)
    # the core path on its own holds the whole site's rule, MAX_SITE_SHARE
    # (`python -m docsite.notes_beside_code` prints the figures page by page)
    assert nbc.site_share(rows) <= nbc.MAX_SITE_SHARE
    assert sum(r.words for r in rows) <= CORE_PATH_WORDS


def test_the_whole_site_sets_each_idea_beside_its_code(site_files):
    # every built page but the home page: the glossary, the Results page and
    # the folder pages included
    rows = nbc.built_rows(site_files)
    assert nbc.site_share(rows) <= nbc.MAX_SITE_SHARE, (
        f"{nbc.site_share(rows):.1%} of the site's note words sit beside no code")
    assert not nbc.rows_over(rows), nbc.rows_over(rows)


def test_measured_tables_are_figures_and_folder_lists_are_titles(site_files):
    results = site_files["results.html"].decode()
    # every measurement row is inside a figure, so the counter reads none of it
    assert '<figure class="data">' in results
    outside = re.sub(r"<figure\b.*?</figure>", " ", results, flags=re.S)
    assert 'id="result-' not in outside
    folder = site_files["labml_zero/zero3/index.html"].decode()
    listing = folder.split("Pages in this folder", 1)[1].split("</ol>", 1)[0]
    # a title a line, its summary on hover, not in the text
    assert re.search(r'<li><a href="[^"]+" title="[^"]+">[^<]+</a></li>', listing)
    assert not re.search(r"</a>\s*:", listing)


def test_no_row_sits_beside_an_empty_code_column(site_files):
    for path, page in pages(site_files):
        assert 'class="code empty"' not in page, path
        for match in nbc.SECTION.finditer(page):
            if '<div class="code">' not in match.group(2):
                assert "doc-only" in match.group(1), (path, match.group(1))


def test_the_counter_reads_rows_openings_and_prose_blocks():
    page = ('<main class="notes">'
            '<section class="row doc-only wide opening" id="section-0">'
            '<div class="doc"><h1>T</h1><p>one two <math>x</math></p></div>'
            '</section><section class="row" id="section-1"><div class="doc">'
            '<p>three <code>hf_prefix(layer)</code></p></div><div class="code">'
            '<pre>ignored words here</pre></div></section></main>')
    prose = ('<main class="prose"><section class="row doc-only" id="section-0">'
             '<div class="doc"><h1>G</h1><p>a b</p><table><tr><td>c d e</td></tr>'
             '<tr><td>f</td></tr></table></div></section></main>')
    rows = nbc.built_rows({"p.html": page.encode(), "g.html": prose.encode(),
                           "index.html": page.encode()})
    assert [(r.page, r.words, r.beside_code, r.opening) for r in rows] == [
        ("g.html", 3, False, True), ("g.html", 3, False, False),
        ("g.html", 1, False, False),
        ("p.html", 4, False, True), ("p.html", 3, True, False)]
    assert nbc.site_share(rows) == pytest.approx(11 / 14)
    long = nbc.BuiltRow("p.html", 1, nbc.MAX_ROW_WORDS + 1, False, False)
    opening = nbc.BuiltRow("p.html", 0, nbc.MAX_OPENING_WORDS, False, True)
    assert nbc.rows_over([long, opening]) == [long]


def test_no_builder_marker_is_shown_to_a_reader(site_files):
    for path, page in pages(site_files):
        notes = re.sub(r"<(pre|script)\b.*?</\1>", " ", page, flags=re.S)
        for marker in ("{{", "}}", "(tested:"):
            assert marker not in notes, (path, marker)


def test_no_lone_check_mark(site_files):
    for path, page in pages(site_files):
        assert not re.search(r'<p[^>]*>\s*<sup class="tested">.*?</sup>\s*</p>',
                             page, re.S), path


def test_every_note_mention_is_a_link():
    renderer = Renderer({"a.html", "b.html"}, {"why-x": ["b.html"]})
    html = renderer.render("As Note: why x\nsays.", "a.html", set())
    assert 'href="b.html#note-why-x"' in html
    renderer.render("As Note: nothing like it says.", "a.html", set())
    assert renderer.unresolved == [
        "a.html: 'Note: nothing like it says' names no note of any page"]


@pytest.mark.parametrize("latex, error", [
    ("k\text{ trainable}", "control character"),
    (r"\eta_{min}", "product of italic letters"),
])
def test_formulas_that_would_render_wrongly_stop_the_build(latex, error):
    with pytest.raises(BuildError, match=error):
        to_mathml(latex, display=False, where="p.html")
    assert to_mathml(r"\eta_\text{min}", display=False, where="p.html")


def test_a_power_typed_as_text_stops_the_build():
    renderer = Renderer({"a.html"}, {})
    with pytest.raises(BuildError, match="power typed as text"):
        renderer.render("A chunk of 2^20 elements.", "a.html", set())
    assert "<math" in renderer.render("A chunk of $2^{20}$ elements.", "a.html",
                                      set())


def test_the_first_mention_of_a_reference_links_to_it():
    cited: set[str] = set()
    text = link_references("As the ZeRO paper says, and the ZeRO paper again.",
                           cited)
    assert text.count("](https://arxiv.org/abs/1910.02054)") == 1
    assert "[labml-nn](x.html)" == link_references("[labml-nn](x.html)", set())
