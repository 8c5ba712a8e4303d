"""
---
title: Markdown, links, notes and figures
summary: Notes to HTML, every link checked against the site.
---

# Markdown, links, notes and figures

Notes are CommonMark (with tables) and dollar math. Besides plain Markdown the
renderer

* turns math into MathML (see the math page, `docsite/mathml.py`);
* resolves relative links against the site's file set: `chunk.py` and
  `chunk.html` both reach the chunk page; a link to a page not written yet becomes
  plain text and a warning;
* gives `## Note: <name>` headings the anchor `note-<slug>`, and links
  `see Note: <name>`, in notes or in code comments, to it (same page first, else
  any page);
* inserts `![alt](figures/NAME.svg)` as the SVG itself (so its hover titles work),
  taken out of the notes column: the page shows it at full width under its row;
* expands the directives of `docsite/directives.py` (`{{py: …}}`,
  `{{bench: …}}`, `{{term: …}}`, `(tested: …)`) outside code.
"""

from __future__ import annotations

import html
import posixpath
import re

from .mathml import to_mathml
from .paths import BuildError, module_page, rel_href, slugify
from .references import link_references

NOTE_HEADING = re.compile(r"^#{1,6}[ \t]+Note:[ \t]*(.+?)[ \t#]*$", re.M)
# Any mention "Note: why storage resize" (after "see" or not) but a heading's own
# or a link's text; the name is matched against the known notes in `note_href`.
NOTE_REF = re.compile(r"(?<![\w\[])()Note:\s*((?:[\w'-]+[ \t\n]*){1,10})")
HEADING_START = re.compile(r"(?:^|\n)[ \t]*#{1,6}[ \t]*$")
CODE_PARTS = re.compile(r"(^```.*?^```[ \t]*$|^~~~.*?^~~~[ \t]*$|`+[^`]*`+)",
                        re.S | re.M)


def outside_code(text: str, fn) -> str:
    """Apply `fn` to the parts of Markdown `text` that are not code."""
    parts = CODE_PARTS.split(text)
    return "".join(p if i % 2 else fn(p) for i, p in enumerate(parts))


# An inline formula as dollarmath reads it: no space inside its dollars, no digit
# right outside them (so "$5 or $10" is not math), no blank line.
INLINE_MATH = re.compile(r"(?<![\\$\d])\$(?=[^\s$])((?:[^$\n]|\n(?![ \t]*\n))+?)"
                         r"(?<![\s\\])\$(?![\d$])")
BLOCK_START = re.compile(r"\n[ \t]*(?=[-+*>#=|]|\d+[.)])")


def join_inline_math(text: str) -> str:
    """
    An inline formula that wraps onto a line starting with `+`, `-`, `1.` or
    `#` would be cut by the block parser (a list, a heading) before the inline
    parser sees its closing `$`: such a formula is joined onto one line.
    """
    def join(match: re.Match) -> str:
        return BLOCK_START.sub(" ", match.group(0))

    parts = re.split(r"(\$\$.*?\$\$)", text, flags=re.S)
    return "".join(p if i % 2 else INLINE_MATH.sub(join, p)
                   for i, p in enumerate(parts))


def inline_math_rule(rule):
    """dollarmath's inline rule with a sound digit guard (see `Renderer`)."""
    def guarded(state, silent: bool) -> bool:
        if state.pos > 0 and state.src[state.pos - 1].isdigit():
            return False
        start, n_tokens = state.pos, len(state.tokens)
        if not rule(state, silent):
            return False
        if state.pos < len(state.src) and state.src[state.pos].isdigit():
            state.pos = start
            del state.tokens[n_tokens:]
            return False
        return True

    return guarded


# A formula's dollars, `$$`, or a TeX command left as text; a lone "$5" is prose.
# (`\n` in prose is not TeX: a command has two letters or more).
TEX_LEFT = re.compile(r"\$\$|\$[^\s$\d](?:[^$]*?[^\s$])?\$(?!\d)|\\[A-Za-z]{2,}")


def visible_text(page_html: str) -> str:
    """What a reader sees as text: the HTML without code, math, figures, tags."""
    for tag in ("math", "pre", "code", "svg", "style", "title", "script"):
        page_html = re.sub(rf"<{tag}\b.*?</{tag}>", " ", page_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page_html))


def raw_tex_left(page_html: str) -> str:
    """The first formula or `\\command` left as text in rendered HTML, or ''."""
    text = visible_text(page_html)
    m = TEX_LEFT.search(text)
    return " ".join(text[max(0, m.start() - 30):m.end() + 30].split()) if m else ""


# `2^20`, `β2^t`, `b^(-2i)`: a power typed as text on a site that sets math.
ASCII_POWER = re.compile(r"(?<![\w/.])[\w\u0370-\u03ff)]+\^[\w(-]+")


def ascii_math(page_html: str) -> str:
    """The first power written as text (`2^20`) in rendered HTML, or ''."""
    text = visible_text(page_html)
    m = ASCII_POWER.search(text)
    return " ".join(text[max(0, m.start() - 30):m.end() + 30].split()) if m else ""


def inline_svg(data: bytes) -> str:
    """An SVG file's markup without its XML prolog, to sit inside HTML."""
    text = data.decode("utf-8")
    text = re.sub(r"\A\s*<\?xml[^>]*\?>\s*", "", text)
    return re.sub(r"\A\s*<!DOCTYPE[^>]*>\s*", "", text).strip()


class Renderer:
    """Markdown -> HTML for one site, with link checking against its file set."""

    def __init__(self, files: set[str], notes: dict[str, list[str]], *,
                 figures: dict[str, bytes] | None = None, directives=None):
        from markdown_it import MarkdownIt
        from mdit_py_plugins.dollarmath import dollarmath_plugin
        from mdit_py_plugins.dollarmath.index import math_inline_dollar

        self.files = files
        self.notes = notes  # note slug -> pages that define it, in reading order
        # figure path -> SVG bytes; a figure not here is linked as an <img>
        self.figure_data = figures or {}
        self.directives = directives
        self.page = ""
        self.warnings: list[str] = []
        self.unresolved: list[str] = []  # "Note: …" mentions that name no note
        self.figures: list[str] = []  # full-width figures of the last render
        md = MarkdownIt("commonmark", {"html": True}).enable("table")
        # allow_space off: "$ HOME" is not math. The plugin's own digit guard reads
        # `src[pos - 1]` at pos 0, which is the text's *last* character: a table
        # cell "$p$, 4, 4" stayed raw. `inline_math_rule` guards digits instead.
        md.use(dollarmath_plugin, allow_space=False, allow_digits=True)
        md.inline.ruler.at("math_inline", inline_math_rule(
            math_inline_dollar(allow_space=False, allow_digits=True)))
        # markdown-it binds render rules to its renderer: pass plain functions.
        for name, method in (
            ("math_inline", self._math_inline),
            ("math_block", self._math_block),
            ("math_block_label", self._math_block),
            ("image", self._image),
        ):
            md.add_render_rule(name, lambda r, *a, _m=method: _m(r, *a))
        md.core.ruler.push("labml_links", self._links)
        md.core.ruler.push("labml_heading_ids", self._heading_ids)
        self.md = md

    def render(self, text: str, page: str, local_notes: set[str]) -> str:
        if page != self.page:
            self.cited: set[str] = set()  # references linked on this page so far
        self.page = page
        self.local_notes = local_notes
        self.used_ids: set[str] = set()
        self.figures = []
        if self.directives is not None:
            text = self.directives.cite(text, page)
            text = outside_code(text, lambda p: self.directives.expand(p, page))
        text = outside_code(text, join_inline_math)
        text = outside_code(text, lambda p: link_references(p, self.cited))
        out = self.md.render(self.link_notes(text, markdown=True))
        # A mark alone in its paragraph (after a display formula) joins the
        # formula's block, at its right; any other lone mark joins the block
        # before it: a paragraph holding only "✓" reads as a stray tick.
        out = re.sub(r'</math></div>\n<p>(<sup class="tested">.*?</sup>)</p>',
                     r'</math>\1</div>', out)
        out = re.sub(r'</(p|li)>\n(?:</[uo]l>\n)?<p>(<sup class="tested">.*?</sup>)'
                     r'</p>', lambda m: m.group(0).replace(
                         "<p>" + m.group(2) + "</p>", "").replace(
                         f"</{m.group(1)}>", m.group(2) + f"</{m.group(1)}>", 1),
                     out)
        left = raw_tex_left(out)
        if left:
            raise BuildError(f"{page}: TeX left as text in the page: {left!r} "
                             "(a formula the parser did not take as math)")
        power = ascii_math(out)
        if power:
            raise BuildError(f"{page}: a power typed as text: {power!r}; write it "
                             "as math ($2^{20}$, $\\beta_2^t$)")
        return out

    # `see Note: why storage resize` -> a link to the note's anchor; the name is the
    # longest run of the words after `Note:` that names a known note.
    def note_href(self, words: str) -> tuple[int, str] | None:
        parts = words.split()
        for n in range(len(parts), 0, -1):
            slug = slugify(" ".join(parts[:n]))
            if slug in self.local_notes:
                return n, f"#note-{slug}"
            pages = self.notes.get(slug)
            if pages:
                return n, f"{rel_href(pages[0], self.page)}#note-{slug}"
        return None

    def link_notes(self, text: str, *, markdown: bool) -> str:
        def replace(match: re.Match) -> str:
            words = match.group(2)
            line_start = match.string.rfind("\n", 0, match.start()) + 1
            if HEADING_START.search(match.string[line_start:match.start()]):
                return match.group(0)  # the note's own heading
            found = self.note_href(words)
            if found is None:
                self.unresolved.append(
                    f"{self.page}: 'Note: {' '.join(words.split()[:6])}' names no "
                    "note of any page")
                return match.group(0)
            n, href = found
            end = list(re.finditer(r"\S+", words))[n - 1].end()
            name = " ".join(words[:end].split())
            if markdown:
                link = f"[Note: {name}]({href})"
            else:
                link = f'<a href="{html.escape(href)}">Note: {name}</a>'
            return f"{link}{words[end:]}"

        if not markdown:
            return NOTE_REF.sub(replace, text)
        return outside_code(text, lambda p: NOTE_REF.sub(replace, p))

    def _math_inline(self, renderer, tokens, idx, options, env) -> str:
        return to_mathml(tokens[idx].content, display=False, where=self.page)

    def _math_block(self, renderer, tokens, idx, options, env) -> str:
        return '<div class="math-block">' + to_mathml(
            tokens[idx].content.strip(), display=True, where=self.page
        ) + "</div>\n"

    def _image(self, renderer, tokens, idx, options, env) -> str:
        token = tokens[idx]
        src = token.attrGet("src") or ""
        alt = renderer.renderInlineAsText(token.children or [], options, env)
        alt = html.escape(alt)
        if src.startswith("figures/"):
            target = posixpath.normpath(src)
            if target not in self.files:
                self.warnings.append(f"{self.page}: missing figure {src}")
                return f'<span class="missing" title="figure not found">{alt}</span>'
            href = html.escape(rel_href(target, self.page))
            data = self.figure_data.get(target)
            if data is None or not target.endswith(".svg"):
                return (f'<a class="figure" href="{href}">'
                        f'<img src="{href}" alt="{alt}"></a>')
            fig_id = f"figure-{slugify(posixpath.basename(target))}"
            k = sum(1 for f in self.figures if f'id="{fig_id}' in f)
            fig_id += f"-{k + 1}" if k else ""
            self.figures.append(
                f'<figure class="wide" id="{fig_id}" role="img" aria-label="{alt}">'
                f"{inline_svg(data)}<figcaption>{alt} "
                f'<a href="{href}">(SVG file)</a></figcaption></figure>'
            )
            return f'<a class="figref" href="#{fig_id}">Figure: {alt} (below)</a>'
        return renderer.image(tokens, idx, options, env)

    def resolve(self, href: str) -> str | None:
        """A relative link -> site-relative target file, or None when missing."""
        path, _, _ = href.partition("#")
        if not path:
            return self.page
        target = posixpath.normpath(posixpath.join(posixpath.dirname(self.page), path))
        candidates = [target]
        if target.endswith(".py"):
            candidates = [module_page(target)]
        elif path.endswith("/") or "." not in posixpath.basename(target):
            candidates = [posixpath.join(target, "index.html")]
        for candidate in candidates:
            if candidate in self.files:
                return candidate
        return None

    def _links(self, state) -> None:
        for block in state.tokens:
            if block.type != "inline" or not block.children:
                continue
            stack = []
            for token in block.children:
                if token.type == "link_open":
                    href = token.attrGet("href") or ""
                    if re.match(r"^[a-z][a-z0-9+.-]*:", href) or href.startswith("#"):
                        stack.append(None)
                        continue
                    target = self.resolve(href)
                    if target is None:
                        self.warnings.append(f"{self.page}: link to missing {href}")
                        token.tag, token.attrs = "span", {
                            "class": "missing",
                            "title": "page not written yet",
                        }
                        stack.append(token)
                        continue
                    fragment = href.partition("#")[2]
                    new = rel_href(target, self.page)
                    token.attrSet("href", new + (f"#{fragment}" if fragment else ""))
                    stack.append(None)
                elif token.type == "link_close":
                    opener = stack.pop() if stack else None
                    if opener is not None:
                        token.tag = "span"

    def _heading_ids(self, state) -> None:
        tokens = state.tokens
        for i, token in enumerate(tokens):
            if token.type != "heading_open":
                continue
            text = tokens[i + 1].content.strip()
            match = re.match(r"^Note:\s*(.+)$", text)
            base = f"note-{slugify(match.group(1))}" if match else slugify(text)
            base = base or "section"
            anchor, k = base, 1
            while anchor in self.used_ids:
                k += 1
                anchor = f"{base}-{k}"
            self.used_ids.add(anchor)
            token.attrSet("id", anchor)


def _formatter():
    from pygments.formatters import HtmlFormatter

    return HtmlFormatter(nowrap=True)


def highlight(code: str) -> str:
    from pygments import highlight as pyg
    from pygments.lexers import PythonLexer

    return pyg(code, PythonLexer(stripnl=False, ensurenl=False), _formatter())


def link_code_notes(code_html: str, renderer: Renderer) -> str:
    """`# see Note: x` inside highlighted comments links to the note too."""

    def comment(match: re.Match) -> str:
        linked = renderer.link_notes(match.group(2), markdown=False)
        return f"{match.group(1)}{linked}</span>"

    return re.sub(r'(<span class="c1?">)(.*?)</span>', comment, code_html)


def source_html(source: str) -> list[tuple[int, str]]:
    """Highlighted lines of a whole file; Pygments closes its spans at line ends."""
    lines = highlight(source).split("\n")
    if lines and lines[-1] == "" and source.endswith("\n"):
        lines.pop()
    return list(enumerate(lines, start=1))
