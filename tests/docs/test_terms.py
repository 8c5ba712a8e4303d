"""A term is defined before it is used: the `{{see: …}}` directive and the check of
docsite/terms.py, on small inputs (the repository's own notes are checked by
tests/docs/test_notes_lint.py)."""

from __future__ import annotations

import re

import pytest

from docsite import terms
from docsite.directives import Directives, strip_directives
from docsite.glossary import Definition
from docsite.paths import REPO, BuildError

MEANINGS = {"chunk": ("chunk", "a flat buffer of $N_d$ shards"),
            "gather-stream": ("gather stream", "the stream of the all-gathers"),
            "w2": ("W2", "a benchmark workload")}


def _uses(pages: list[terms.Notes]) -> list[str]:
    """The findings about pages (not about the glossary's list)."""
    return [f for f in terms.findings(pages, MEANINGS)
            if not f.startswith("docs_src/glossary.txt")]


def _pages(*texts: str) -> list[terms.Notes]:
    names = ["docs_src/index.md"] + [f"labml_zero/p{i}.py" for i in range(1, 9)]
    outs = ["index.html"] + [f"labml_zero/p{i}.html" for i in range(1, 9)]
    return [terms.Notes(n, o, t) for n, o, t in zip(names, outs, texts)]


def test_an_earlier_page_that_uses_a_term_is_a_finding():
    pages = _pages("Every Chunks matter.", "Two gather\nstreams.",
                   "A {{term: chunk}}; the {{term: gather stream}}.")
    assert _uses(pages) == [
        "docs_src/index.md | chunk", "labml_zero/p1.py | gather stream"]


def test_only_prose_counts():
    early = ("`chunk` and\n```\nchunk = 1\n```\n[the buffer](chunk.html) "
             '<span id="chunk"></span> chunk_layout, chunky, '
             "{{see: chunks | chunk}}, {{py: chunk.size}}, {{bench: W2 x tokens_per_s}}"
             ", W2-1 and W2-1O, ZeRO-Chunk")
    pages = _pages(early, "A {{term: chunk}}; {{term: W2}}.")
    assert _uses(pages) == []
    assert terms.mentions("the chunk's shard; CHUNKS", "chunk") == [4, 19]


def test_a_see_introduces_the_term_for_the_rest_of_its_page():
    pages = _pages("W2 runs; {{see: W2}} again; W2 once more.",
                   "chunks, then {{see: chunk}}: chunks",
                   "A {{term: chunk}}; {{term: W2}}")
    assert _uses(pages) == [
        "docs_src/index.md | W2", "labml_zero/p1.py | chunk"]
    pages[0] = terms.Notes("docs_src/index.md", "index.html", "{{see: W2}}; W2.")
    # a see written as code is not one
    pages[1] = terms.Notes("labml_zero/p1.py", "labml_zero/p1.html",
                           "`{{see: chunk}}` chunk")
    assert _uses(pages) == ["labml_zero/p1.py | chunk"]


def test_the_defining_page_may_not_use_the_term_before_its_marker():
    before = _pages("", "# Chunks\n\nA chunk is... a {{term: chunk}}.")
    assert _uses(before) == ["labml_zero/p1.py | chunk"]
    # its headings may name what it defines, and after the marker anything goes
    titled = _pages("", "# Chunks\n\n## The chunk\n\nA {{term: chunk}}; chunks.")
    assert _uses(titled) == []
    # another page's headings are uses
    assert _uses(_pages("## Chunks", "A {{term: chunk}}")) == [
        "docs_src/index.md | chunk"]


def test_a_glossary_term_that_no_page_defines_is_a_finding():
    pages = _pages("", "A {{term: chunk}}, a {{term: gather stream}}.")
    assert terms.findings(pages, MEANINGS) == ["docs_src/glossary.txt | W2"]


def test_generated_pages_define_but_are_not_read():
    pages = _pages("{{see: W2}} first", "a {{term: chunk}}")
    pages[1:] = [pages[1], terms.Notes("@results", "results.html",
                                       "* {{term: W2}}: a job. chunk")]
    pages.append(terms.Notes("@glossary", "glossary.html", "W2 chunk"))
    assert terms.definitions(pages, MEANINGS)["w2"] == ("W2", 2, 2)
    assert _uses(pages) == []
    pages[0] = terms.Notes("docs_src/index.md", "index.html", "W2 first")
    assert _uses(pages) == ["docs_src/index.md | W2"]


def test_see_links_to_the_definition_with_its_meaning():
    defs = {"gather-stream": Definition("gather stream", "labml_zero/zero3/index.html",
                                        "ZeRO-3"),
            "chunk": Definition("chunk", "labml_zero/zero3/index.html", "ZeRO-3")}
    d = Directives(REPO, {}, definitions=defs, meanings=MEANINGS)
    assert d.expand("the {{see: gather stream}}", "index.html") == (
        'the <a class="term-ref" href="labml_zero/zero3/index.html#term-gather-stream"'
        ' title="the stream of the all-gathers">gather stream</a>')
    linked = d.expand("{{see: chunks | chunk}}", "labml_zero/zero3/index.html")
    assert linked == ('<a class="term-ref" href="index.html#term-chunk" '
                      'title="a flat buffer of N_d shards">chunks</a>')
    with pytest.raises(BuildError, match=r"p\.html: \{\{see: gather lane\}\}: "
                                         "no page defines 'gather lane'"):
        d.expand("{{see: gather lane}}", "p.html")
    assert strip_directives("{{see: W2}} runs") == "  runs"


def test_the_check_reads_a_repository_in_its_reading_order(tmp_path):
    (tmp_path / "docs_src").mkdir()
    (tmp_path / "labml_zero").mkdir()
    (tmp_path / "docs_src" / "index.md").write_text(
        "---\ntitle: Home\n---\n# Home\n\nShards, then {{see: chunks | chunk}}.\n")
    (tmp_path / "docs_src" / "glossary.txt").write_text(
        "chunk: a buffer\nshard: a slice\n")
    (tmp_path / "docs_src" / "reading_order.txt").write_text(
        "labml_zero/__init__.py\nlabml_zero/a.py\n@results\n@glossary\n")
    (tmp_path / "labml_zero" / "__init__.py").write_text(
        '"""\n# Root\n\nA {{term: chunk}} of shards.\n"""\n')
    (tmp_path / "labml_zero" / "a.py").write_text(
        '"""\n# A\n\nA {{term: shard}}.\n"""\n# a shard of the chunk\nx = 1\n')
    assert terms.check(tmp_path) == ["docs_src/index.md | shard",
                                     "labml_zero/__init__.py | shard"]


def test_the_site_links_early_uses_to_their_definition(site_files):
    home = site_files["index.html"].decode()
    assert re.search(r'<a class="term-ref" href="results\.html#term-w2" '
                     r'title="benchmark workload, [^"]+">W2</a>', home)
    assert '<dfn id="term-w2">W2</dfn>' in site_files["results.html"].decode()
