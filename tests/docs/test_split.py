"""The splitter and the Markdown renderer on the sources labml-style modules contain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import build_docs  # noqa: E402
from build_docs import Renderer, split_source  # noqa: E402


def sections(source: str) -> list[tuple[str, str, int]]:
    return [(s.doc, s.code, s.lineno) for s in split_source(source).sections]


def test_front_matter_and_module_docstring():
    src = '''"""
---
title: Chunks
summary: "Flat buffers: one per group."
---

# Chunks

Intro with $x$.
"""

import math
'''
    split = split_source(src)
    assert split.front == {"title": "Chunks", "summary": "Flat buffers: one per group."}
    assert [(s.doc, s.code) for s in split.sections] == [
        ("# Chunks\n\nIntro with $x$.", ""),
        ("", "import math"),
    ]
    assert split.sections[1].lineno == 12


def test_an_indented_front_matter_line_continues_the_value_above():
    src = '''"""
---
title: Atomic files
summary: Write a file so that a crash leaves the old one or
  the new one: never a part.
---
"""
'''
    assert split_source(src).front == {
        "title": "Atomic files",
        "summary": "Write a file so that a crash leaves the old one or the new one: "
                   "never a part."}


def test_indented_comments_split_a_method_and_keep_indentation():
    src = '''class A:
    def f(self):
        x = 1

        # Why y:
        # it is the *invariant*.
        y = x + 1
        return y
'''
    assert sections(src) == [
        ("", "class A:\n    def f(self):\n        x = 1", 1),
        ("Why y:\nit is the *invariant*.", "        y = x + 1\n        return y", 7),
    ]


def test_decorators_and_docstrings_sit_beside_the_def_line():
    src = '''import dataclasses


# A comment right above the decorator
# joins the docstring.
@dataclasses.dataclass(
    frozen=True,
)
class Spec:
    """
    ## Spec

    What a parameter needs.
    """

    name: str
'''
    result = sections(src)
    assert result[0] == ("", "import dataclasses", 1)
    doc, code, lineno = result[1]
    assert doc == (
        "A comment right above the decorator\njoins the docstring.\n\n"
        "## Spec\n\nWhat a parameter needs."
    )
    assert code == (
        "@dataclasses.dataclass(\n    frozen=True,\n)\nclass Spec:\n\n    name: str"
    )
    assert lineno == 6
    assert '"""' not in code


def test_nested_functions_get_their_own_sections():
    src = '''def outer(n: int):
    """
    ### Outer
    """
    total = 0

    def inner(k: int) -> int:
        """#### Inner helper"""
        return k * 2

    return inner(n) + total
'''
    result = sections(src)
    assert [d for d, _, _ in result] == ["### Outer", "#### Inner helper"]
    assert result[0][1] == "def outer(n: int):\n    total = 0"
    assert result[1][1] == (
        "    def inner(k: int) -> int:\n        return k * 2\n\n"
        "    return inner(n) + total"
    )
    assert result[1][2] == 7


def test_hash_inside_strings_and_docstrings_is_not_a_comment():
    src = '''def f():
    """
    # A heading inside a docstring

    See `x = 1  # not a comment`.
    """
    a = "# not a comment"
    b = """
# also not a comment
"""
    return a + b  # a trailing comment stays in the code
'''
    (doc, code, _), = sections(src)
    assert doc.startswith("# A heading inside a docstring")
    assert '# not a comment"' in code and "\n# also not a comment\n" in code
    assert code.endswith("# a trailing comment stays in the code")


def test_shebang_encoding_and_pragmas_stay_code():
    src = '''#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""Doc."""
# noqa: E501
x = 1
'''
    result = sections(src)
    assert result[0] == ("Doc.", "#!/usr/bin/env python\n# -*- coding: utf-8 -*-", 1)
    assert result[1] == ("", "# noqa: E501\nx = 1", 4)


def test_comments_inside_brackets_do_not_split_an_expression():
    src = '''total = sum(
    # the first term
    [1, 2],
)
'''
    assert sections(src) == [("", src.rstrip("\n"), 1)]


def test_blank_lines_and_consecutive_comment_blocks():
    src = '''x = 1


# First paragraph.

# Second paragraph,
#
# third.


y = 2

z = 3
'''
    result = sections(src)
    assert result == [
        ("", "x = 1", 1),
        ("First paragraph.\n\nSecond paragraph,\n\nthird.", "y = 2\n\nz = 3", 11),
    ]


def test_one_line_docstring_on_the_def_line_stays_code():
    src = 'def f(): """Doc."""\n'
    assert sections(src) == [("", 'def f(): """Doc."""', 1)]


def test_syntax_error_raises():
    with pytest.raises(SyntaxError):
        split_source("def f(:\n")


# ---------------------------------------------------------------- rendering


def render(text: str, *, files=(), notes=None, page="labml_zero/zero3/a.html",
           local=()) -> tuple[str, Renderer]:
    renderer = Renderer(set(files) | {page}, notes or {})
    return renderer.render(text, page, set(local)), renderer


def test_math_becomes_mathml_and_dollars_that_are_not_math_stay_text():
    out, _ = render(
        "Each rank holds $\\frac{(2+2+K)\\Psi}{N_d}$ bytes; it costs $5 or $10, "
        "and `echo $HOME` is code.\n\n$$\nx^2\n$$\n"
    )
    assert out.count("<math") == 2
    assert 'display="block"' in out
    assert "costs $5 or $10" in out
    assert "<code>echo $HOME</code>" in out


def test_links_resolve_relative_to_the_page_or_become_plain_text():
    files = {"labml_zero/zero3/chunk.html", "labml_zero/optimizers/adam_fp16.html",
             "labml_zero/neox/index.html"}
    out, renderer = render(
        "[chunks](chunk.html), [adam](../optimizers/adam_fp16.py#top), "
        "[neox](../neox/), [later](finetune.html), [web](https://example.com)",
        files=files,
    )
    assert '<a href="chunk.html">chunks</a>' in out
    assert '<a href="../optimizers/adam_fp16.html#top">adam</a>' in out
    assert '<a href="../neox/index.html">neox</a>' in out
    assert '<span class="missing" title="page not written yet">later</span>' in out
    assert '<a href="https://example.com">web</a>' in out
    assert any("finetune.html" in w for w in renderer.warnings)


def test_note_headings_get_anchors_and_references_link_to_them():
    out, _ = render(
        "## Note: why storage resize\n\nText.\n\n"
        "Resize it (see Note: why storage\nresize). And see Note: chunk order.",
        notes={"chunk-order": ["labml_zero/zero3/b.html"]},
        files={"labml_zero/zero3/b.html"},
        local={"why-storage-resize"},
    )
    assert '<h2 id="note-why-storage-resize">' in out
    assert '<a href="#note-why-storage-resize">Note: why storage resize</a>).' in out
    assert '<a href="b.html#note-chunk-order">Note: chunk order</a>.' in out


def test_note_references_in_code_comments_link_too():
    _, renderer = render("", local={"why-storage-resize"})
    code = build_docs.highlight("x = 1  # see Note: why storage resize\n")
    linked = build_docs.link_code_notes(code, renderer)
    assert '<a href="#note-why-storage-resize">Note: why storage resize</a>' in linked


def test_figures_resolve_from_any_depth():
    out, renderer = render(
        "![layout](figures/chunk_layout.svg) ![typo](figures/nope.svg)",
        files={"figures/chunk_layout.svg"},
    )
    assert '<img src="../../figures/chunk_layout.svg" alt="layout">' in out
    assert "figures/nope.svg" not in out
    assert any("nope.svg" in w for w in renderer.warnings)


def test_docstrings_render_as_written_even_without_the_r_prefix():
    src = 'def f():\n    """Holds $\\frac{a}{b}$ and \\\\."""\n    return 1\n'
    assert sections(src)[0][0] == "Holds $\\frac{a}{b}$ and \\\\."


def test_escaped_underscores_in_text_math_are_unescaped():
    out, _ = render("at most $1 + \\text{prefetch\\_depth}$ units")
    assert "<mtext>prefetch_depth</mtext>" in out
