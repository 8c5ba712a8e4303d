"""The glossary and the Results page set each note beside the code it is about
(`docsite/glossary.py`, `docsite/results.py`, `docsite/snippets.py`)."""

from __future__ import annotations

import html
import re

import pytest

from docsite import glossary, results
from docsite.paths import REPO, BuildError, slugify
from docsite.snippets import code_of, head

SECTION = re.compile(r'<section class="row[^"]*"[^>]*>(.*?)</section>', re.S)


def _rows(page: str) -> list[str]:
    return SECTION.findall(page)


def test_every_glossary_term_sits_beside_code_linked_to_its_lines(site_files):
    page = site_files["glossary.html"].decode()
    meanings = glossary.read_meanings(REPO)
    beside = {}
    for row in _rows(page):
        anchor = re.search(r'id="glossary-([^"]+)"', row)
        if anchor:
            beside[anchor.group(1)] = row
    assert set(meanings) <= set(beside)
    # every term but those whose definition names no code: labml-nn, a project
    without_code = {s for s, row in beside.items() if 'class="code"' not in row}
    assert without_code == {slugify("labml-nn")}
    for slug, row in beside.items():
        link = re.search(r'class="line" href="(source/[^"#]+)\.html#L(\d+)"', row)
        if slug in without_code:
            continue
        file, line = link.group(1)[len("source/"):], int(link.group(2))
        assert f"source/{file}.html" in site_files, slug
        # the first line shown is that line of the file
        first = (REPO / file).read_text(encoding="utf-8").splitlines()[line - 1]
        shown = re.sub(r"<[^>]+>", "", row.split('<pre class="highlight">', 1)[1])
        assert html.unescape(shown).splitlines()[0].strip() == first.strip(), slug


def test_glossary_code_names_exist():
    for slug, (file, name) in glossary.read_code_names(REPO).items():
        assert code_of(REPO, file, name) is not None, (slug, file)


def test_results_columns_sit_beside_the_code_that_computes_them(site_files):
    page = site_files["results.html"].decode()
    rows = _rows(page)
    headings = ("workload and B × T", "engine", "compiled, GPUs and settings",
                "step s (± std)", "tokens/s", "MFU", "peak GiB", "loss",
                "Why engines’ losses differ on one workload")
    for heading in headings:
        found = [r for r in rows if re.search(rf"<h3[^>]*>{re.escape(heading)}",
                                              r.replace("&#x27;", "’").replace(
                                                  "'", "’"))]
        assert len(found) == 1, heading
        assert 'class="code"' in found[0], heading
    # the loss column's row shows the code that draws the data
    loss = next(r for r in rows if re.search(r"<h3[^>]*>loss<", r))
    assert "random_batches" in loss


def test_snippets_find_functions_methods_and_start_lines(tmp_path):
    (tmp_path / "m.py").write_text(
        "import x\n\n@dec\ndef f(a,\n      b):\n    y = 1\n    return y\n\n"
        "class C:\n    def g(self):\n        return 2\n")
    s = code_of(tmp_path, "m.py", "f")
    assert (s.lineno, s.code.splitlines()[0]) == (3, "@dec")
    assert head(s.code, 6) == "@dec\ndef f(a,\n      b):"
    assert code_of(tmp_path, "m.py", "C.g").lineno == 10
    assert code_of(tmp_path, "m.py", "f", 1, "return").code == "    return y"
    assert code_of(tmp_path, "absent.py", "f") is None
    with pytest.raises(BuildError, match="no function or class 'h'"):
        code_of(tmp_path, "m.py", "h")
    with pytest.raises(BuildError, match="has no line with"):
        code_of(tmp_path, "m.py", "f", 0, "nowhere")


def test_a_glossary_line_with_a_bad_code_mark_stops_the_build(tmp_path):
    (tmp_path / "docs_src").mkdir()
    (tmp_path / glossary.GLOSSARY_FILE).write_text("chunk: a buffer | code: x\n")
    with pytest.raises(BuildError, match="glossary.txt:1"):
        glossary.read_meanings(tmp_path)
    (tmp_path / glossary.GLOSSARY_FILE).write_text(
        "chunk: a buffer | code: a.py:Chunk\n")
    assert glossary.read_code_names(tmp_path) == {"chunk": ("a.py", "Chunk")}
    assert glossary.read_meanings(tmp_path) == {"chunk": ("chunk", "a buffer")}
