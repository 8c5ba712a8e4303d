"""
Build the notes site: every module of `labml_zero/` as a two-column page.

    python build_docs.py                 write site/
    python build_docs.py --check         exit 1 and list stale files if site/ differs
    python build_docs.py --site DIR      use DIR instead of site/

Pipeline: split each `.py` into (notes, code) sections with `tokenize`/`ast`
(`split_source`), render notes with markdown-it-py + dollarmath, turn math into MathML
at build time (latex2mathml), highlight code with Pygments, fill
`docs_src/templates/page.html` with Jinja2. Output is deterministic: same sources,
byte-identical files.

Conventions the splitter understands (see `split_source`):

* the module docstring is the page intro; its front matter
  (`---\\ntitle: …\\nsummary: …\\n---`) feeds the title and description meta;
* a class/function docstring is the note beside its `def`/`class` line (decorators
  and a multi-line signature included); a comment block just above is merged in;
* a block of full-line `#` comments, at any indentation, is the note of the code
  that follows it, up to the next comment block or docstring; comments inside
  brackets, trailing comments and pragmas (`# noqa`, `# type:` …) stay code;
* `## Note: <name>` headings get the anchor `note-<slug>`; `see Note: <name>`, in
  notes or in code comments, links to it (same page first, else any page);
* `![alt](figures/NAME.svg)` inserts a figure from `site/figures/` at any depth.
"""

from __future__ import annotations

import argparse
import ast
import html
import importlib.util
import io
import json
import os
import posixpath
import re
import sys
import tempfile
import tokenize
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent
PACKAGE = "labml_zero"
DOCS_SRC = REPO / "docs_src"
DEFAULT_SITE = REPO / "site"

# Full-line comments that are instructions to tools, not notes: they stay code.
PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|pragma|pylint:|ruff:|isort:|mypy:)")
CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")
FRONT_MATTER = re.compile(r"\A---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.S)
NOTE_HEADING = re.compile(r"^#{1,6}[ \t]+Note:[ \t]*(.+?)[ \t#]*$", re.M)
NOTE_REF = re.compile(r"\b([Ss]ee) Note:[ \t]*((?:[\w'-]+[ \t\n]*){1,10})")


class BuildError(Exception):
    pass


# ---------------------------------------------------------------- splitting


@dataclass
class Section:
    """One row of a page: notes (Markdown) beside code starting at `lineno`."""

    doc: str
    code: str
    lineno: int  # 1-based line of the first code line; 0 when there is no code


@dataclass
class SplitModule:
    front: dict[str, str]
    sections: list[Section]


@dataclass
class _Open:
    docs: list[str] = field(default_factory=list)
    code: list[tuple[int, str]] = field(default_factory=list)

    def has_code(self) -> bool:
        return any(text.strip() for _, text in self.code)


def parse_front_matter(doc: str) -> tuple[dict[str, str], str]:
    """`---\\nkey: value\\n---` at the top of a docstring -> (dict, rest)."""
    match = FRONT_MATTER.match(doc)
    if not match:
        return {}, doc
    front = {}
    for line in match.group(1).splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            front[key.strip()] = value
    return front, doc[match.end():]


def _docstring_node(body: list[ast.stmt]) -> ast.Expr | None:
    if body and isinstance(body[0], ast.Expr):
        value = body[0].value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return body[0]
    return None


def _clean_doc(text: str) -> str:
    import inspect

    return inspect.cleandoc(text)


def _docstring_text(source: str, node: ast.Expr) -> str:
    r"""
    The docstring as written in the file, not as Python evaluates it: without the
    `r` prefix, `\frac` in a docstring would evaluate to a form feed and `rac`;
    the page shows what the author typed.
    """
    literal = ast.get_source_segment(source, node.value) or ""
    match = re.match(r"^[rRuU]?(\"\"\"|'''|\"|')", literal)
    if not match or not literal.endswith(match.group(1)):
        return _clean_doc(node.value.value)  # implicit concatenation: use the value
    quote = match.group(1)
    return _clean_doc(literal[match.end() : len(literal) - len(quote)])


def _alone_on_lines(node: ast.Expr, lines: list[str]) -> bool:
    """True when nothing but the string (and a comment) sits on its lines."""
    first = lines[node.lineno - 1]
    last = lines[node.end_lineno - 1]
    rest = last[node.end_col_offset:].strip()
    return first[: node.col_offset].strip() == "" and (not rest or rest[0] == "#")


def split_source(source: str) -> SplitModule:
    """
    Split Python source into sections of (notes, code).

    Raises `SyntaxError` when the source does not parse.
    """
    with warnings.catch_warnings():
        # "invalid escape sequence" in a docstring is the module's business.
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        tree = ast.parse(source)
    lines = source.splitlines()
    n_lines = len(lines)

    # Full-line comments outside brackets, by line; tokenize knows what is inside a
    # string, so a `#` in a string or docstring is never a comment here.
    comments: dict[int, str] = {}
    depth = 0
    readline = io.StringIO(source).readline
    for tok in tokenize.generate_tokens(readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.COMMENT:
            row, col = tok.start
            if depth or tok.line[:col].strip() or PRAGMA.match(tok.string):
                continue
            if row == 1 and tok.string.startswith("#!"):
                continue
            if row <= 2 and CODING.match(tok.line):
                continue
            text = tok.string[1:]
            comments[row] = text[1:] if text.startswith(" ") else text

    # Docstrings: the module's, then every class/function's, keyed by the first
    # line of the block they annotate (decorators included).
    front: dict[str, str] = {}
    module_doc = None
    node = _docstring_node(tree.body)
    if node is not None and _alone_on_lines(node, lines):
        front, text = parse_front_matter(_docstring_text(source, node))
        module_doc = (node.lineno, node.end_lineno, text.strip())

    headers: dict[int, tuple[int, int, str]] = {}
    for owner in ast.walk(tree):
        if not isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        node = _docstring_node(owner.body)
        if node is None or node.lineno <= owner.lineno:
            continue
        if not _alone_on_lines(node, lines):
            continue
        start = min([d.lineno for d in owner.decorator_list] + [owner.lineno])
        headers[start] = (node.lineno, node.end_lineno, _docstring_text(source, node))

    sections: list[Section] = []

    def flush(block: _Open) -> None:
        code = list(block.code)
        while code and not code[0][1].strip():
            code.pop(0)
        while code and not code[-1][1].strip():
            code.pop()
        doc = "\n\n".join(d for d in block.docs if d.strip()).strip("\n")
        if doc or code:
            text = "\n".join(t.rstrip() for _, t in code)
            sections.append(Section(doc, text, code[0][0] if code else 0))

    block = _Open()
    line = 1
    if module_doc is not None:
        first, last, text = module_doc
        # Shebang, encoding and licence lines above the docstring are shown as code.
        block.code = [(i, lines[i - 1]) for i in range(1, first)]
        block.docs.append(text)
        flush(block)
        block = _Open()
        line = last + 1
    while line <= n_lines:
        if line in headers:
            doc_first, doc_last, text = headers[line]
            # A comment block right above a decorated def joins its docstring.
            if block.has_code():
                flush(block)
                block = _Open()
            block.code.extend((i, lines[i - 1]) for i in range(line, doc_first))
            block.docs.append(text)
            line = doc_last + 1
            continue
        if line in comments:
            if block.has_code():
                flush(block)
                block = _Open()
            group = []
            while line in comments:
                group.append(comments[line])
                line += 1
            block.docs.append("\n".join(group))
            continue
        block.code.append((line, lines[line - 1]))
        line += 1
    flush(block)
    return SplitModule(front, sections)


# ---------------------------------------------------------------- pages and links


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def module_page(rel_py: str) -> str:
    """`labml_zero/zero3/__init__.py` -> `labml_zero/zero3/index.html`."""
    stem = rel_py[: -len(".py")]
    if stem.endswith("/__init__") or stem == "__init__":
        return stem[: -len("__init__")] + "index.html"
    return stem + ".html"


def source_page(rel_py: str) -> str:
    return f"source/{rel_py}.html"


def rel_href(target: str, from_page: str) -> str:
    """Relative URL from one site file to another (both site-relative)."""
    return posixpath.relpath(target, posixpath.dirname(from_page) or ".")


@dataclass
class Page:
    rel_py: str | None  # None for the home page
    out: str
    title: str
    summary: str
    sections: list[Section]
    error: str = ""


def discover_modules(root: Path) -> list[str]:
    pkg = root / PACKAGE
    found = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/"):
            continue
        found.append(rel)
    return sorted(found)


def load_module_page(root: Path, rel_py: str) -> Page:
    source = (root / rel_py).read_text(encoding="utf-8")
    try:
        split = split_source(source)
        error = ""
    except SyntaxError as exc:
        # A file someone is half-way through writing still gets a page.
        split = SplitModule({}, [Section("", source.rstrip("\n"), 1)])
        error = f"This file does not parse yet ({exc.msg}, line {exc.lineno})."
    title = split.front.get("title", "")
    if not title:
        for section in split.sections:
            match = re.search(r"^#[ \t]+(.+)$", section.doc, re.M)
            if match:
                title = match.group(1).strip()
                break
    return Page(
        rel_py,
        module_page(rel_py),
        title or rel_py,
        split.front.get("summary", ""),
        split.sections,
        error,
    )


def reading_order(index_md: str, modules: list[str]) -> list[str]:
    """Modules linked from the home page, in link order, then the rest by path."""
    ordered: list[str] = []
    for target in re.findall(r"\]\(([^)\s#]+)", index_md):
        target = posixpath.normpath(target)
        if target.endswith("/") or not target.endswith(".py"):
            target = posixpath.join(target, "__init__.py")
        if target in modules and target not in ordered:
            ordered.append(target)
    return ordered + [m for m in modules if m not in ordered]


# ---------------------------------------------------------------- markdown and math


def _math_to_mathml(latex: str, *, display: bool) -> str:
    from latex2mathml.converter import convert

    try:
        mathml = convert(latex, display="block" if display else "inline")
    except Exception as exc:  # noqa: BLE001 -- a bad formula must not stop the site
        print(f"warning: math not converted ({exc}): {latex!r}", file=sys.stderr)
        return f'<code class="math-error">{html.escape(latex)}</code>'
    # latex2mathml keeps the escapes of `\text{prefetch\_depth}` in its <mtext>.
    return re.sub(
        r"<mtext>(.*?)</mtext>",
        lambda m: "<mtext>" + re.sub(r"\\([_%&#$])", r"\1", m.group(1)) + "</mtext>",
        mathml,
    )


class Renderer:
    """Markdown -> HTML for one site, with link checking against its file set."""

    def __init__(self, files: set[str], notes: dict[str, list[str]]):
        from markdown_it import MarkdownIt
        from mdit_py_plugins.dollarmath import dollarmath_plugin

        self.files = files
        self.notes = notes  # note slug -> pages that define it, in reading order
        self.page = ""
        self.warnings: list[str] = []
        md = MarkdownIt("commonmark", {"html": True}).enable("table")
        # allow_space/allow_digits off: "$5 or $10" and "$ HOME" are not math.
        md.use(dollarmath_plugin, allow_space=False, allow_digits=False)
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
        self.page = page
        self.local_notes = local_notes
        self.used_ids: set[str] = set()
        return self.md.render(self.link_notes(text, markdown=True))

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
            found = self.note_href(words)
            if found is None:
                self.warnings.append(f"{self.page}: unresolved 'Note: {words.strip()}'")
                return match.group(0)
            n, href = found
            end = list(re.finditer(r"\S+", words))[n - 1].end()
            name = " ".join(words[:end].split())
            if markdown:
                link = f"[Note: {name}]({href})"
            else:
                link = f'<a href="{html.escape(href)}">Note: {name}</a>'
            return f"{match.group(1)} {link}{words[end:]}"

        if not markdown:
            return NOTE_REF.sub(replace, text)
        # Leave code spans alone.
        parts = re.split(r"(`+[^`]*`+)", text)
        return "".join(
            p if i % 2 else NOTE_REF.sub(replace, p) for i, p in enumerate(parts)
        )

    def _math_inline(self, renderer, tokens, idx, options, env) -> str:
        return _math_to_mathml(tokens[idx].content, display=False)

    def _math_block(self, renderer, tokens, idx, options, env) -> str:
        return '<div class="math-block">' + _math_to_mathml(
            tokens[idx].content.strip(), display=True
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
            return (
                f'<a class="figure" href="{href}"><img src="{href}" alt="{alt}"></a>'
            )
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


# ---------------------------------------------------------------- code


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


# ---------------------------------------------------------------- the site


def _load_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is built.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def build_figures(root: Path) -> dict[str, bytes]:
    diagrams = _load_path("_labml_zero_diagrams", DOCS_SRC / "diagrams.py")
    figures_src = root / "docs_src" / "figures"
    out: dict[str, bytes] = {}
    out["figures/chunk_layout.svg"] = diagrams.chunk_layout_svg(root).encode()
    trace_path = figures_src / "step_timeline.json"
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    out["figures/step_timeline.svg"] = diagrams.timeline_svg(
        trace, where=str(trace_path.relative_to(root))
    ).encode()
    # Hand-drawn figures dropped into docs_src/figures/ are copied as they are.
    for path in sorted(figures_src.iterdir()):
        if path.suffix in {".svg", ".png"} and f"figures/{path.name}" not in out:
            out[f"figures/{path.name}"] = path.read_bytes()
    return out


def build_site(root: Path = REPO) -> dict[str, bytes]:
    """Every file of the site, by site-relative path."""
    import jinja2
    from pygments.formatters import HtmlFormatter

    docs_src = root / "docs_src"
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(docs_src / "templates")),
        autoescape=jinja2.select_autoescape(["html"]),
        keep_trailing_newline=True,
    )
    template = env.get_template("page.html")

    out: dict[str, bytes] = {}
    for path in sorted((docs_src / "static").iterdir()):
        if path.is_file():
            out[f"static/{path.name}"] = path.read_bytes()
    out["static/pygments.css"] = (
        HtmlFormatter(style="default").get_style_defs(".highlight") + "\n"
    ).encode()
    out.update(build_figures(root))

    modules = discover_modules(root)
    index_text = (docs_src / "index.md").read_text(encoding="utf-8")
    index_front, index_body = parse_front_matter(index_text)
    order = reading_order(index_text, modules)
    pages = [Page(None, "index.html", index_front.get("title", PACKAGE),
                  index_front.get("summary", ""), [Section(index_body, "", 0)])]
    pages += [load_module_page(root, rel) for rel in order]
    by_py = {p.rel_py: p for p in pages if p.rel_py}

    files = set(out) | {p.out for p in pages}
    files |= {source_page(m) for m in modules}

    notes: dict[str, list[str]] = {}
    page_notes: dict[str, set[str]] = {}
    for page in pages:
        slugs = set()
        for section in page.sections:
            for name in NOTE_HEADING.findall(section.doc):
                slugs.add(slugify(name))
        page_notes[page.out] = slugs
        for slug in sorted(slugs):
            notes.setdefault(slug, []).append(page.out)

    renderer = Renderer(files, notes)
    for i, page in enumerate(pages):
        prev_page = pages[i - 1] if i > 0 else None
        next_page = pages[i + 1] if i + 1 < len(pages) else None

        def link(target: Page | None, page=page) -> dict | None:
            if target is None:
                return None
            return {"href": rel_href(target.out, page.out), "title": target.title}

        rows = []
        for k, section in enumerate(page.sections):
            doc_html = renderer.render(section.doc, page.out, page_notes[page.out])
            code_html = src = ""
            if section.code:
                code_html = link_code_notes(highlight(section.code), renderer)
            if section.code and page.rel_py:
                src_page = rel_href(source_page(page.rel_py), page.out)
                src = f"{src_page}#L{section.lineno}"
            rows.append({"id": f"section-{k}", "doc": doc_html, "code": code_html,
                         "lineno": section.lineno, "src": src})

        crumbs = [{"href": rel_href("index.html", page.out), "title": "Home"}]
        if page.rel_py:
            parts = page.rel_py.split("/")
            for d in range(1, len(parts)):
                pkg_init = "/".join(parts[:d]) + "/__init__.py"
                pkg_page = by_py.get(pkg_init)
                href = ""
                if pkg_page is not None and pkg_page is not page:
                    href = rel_href(pkg_page.out, page.out)
                crumbs.append({"href": href, "title": parts[d - 1]})
            if not page.rel_py.endswith("__init__.py"):
                crumbs.append({"href": "", "title": parts[-1]})

        context = {
            "title": page.title,
            "summary": page.summary,
            "home": page.rel_py is None,
            "root": rel_href("index.html", page.out).rsplit("index.html", 1)[0],
            "crumbs": crumbs,
            "prev": link(prev_page),
            "next": link(next_page),
            "rows": rows,
            "error": page.error,
            "rel_py": page.rel_py or "",
            "source_href": (
                rel_href(source_page(page.rel_py), page.out) if page.rel_py else ""
            ),
        }
        out[page.out] = template.render(kind="page", **context).encode()

    for rel in modules:
        source = (root / rel).read_text(encoding="utf-8")
        page_out = source_page(rel)
        context = {
            "title": rel,
            "summary": f"Source of {rel}",
            "home": False,
            "root": rel_href("index.html", page_out).rsplit("index.html", 1)[0],
            "crumbs": [{"href": rel_href("index.html", page_out), "title": "Home"},
                       {"href": rel_href(module_page(rel), page_out), "title": rel},
                       {"href": "", "title": "source"}],
            "prev": None,
            "next": None,
            "lines": source_html(source),
        }
        out[page_out] = template.render(kind="source", **context).encode()

    for warning in sorted(set(renderer.warnings)):
        print(f"warning: {warning}", file=sys.stderr)
    return dict(sorted(out.items()))


def stale_files(site: Path, files: dict[str, bytes]) -> list[str]:
    """Files that differ, are missing from `site`, or should not be there."""
    stale = []
    for rel, data in files.items():
        path = site / rel
        if not path.is_file() or path.read_bytes() != data:
            stale.append(rel)
    if site.is_dir():
        for path in site.rglob("*"):
            if path.is_file() and path.relative_to(site).as_posix() not in files:
                stale.append(path.relative_to(site).as_posix())
    return sorted(stale)


def write_site(site: Path, files: dict[str, bytes]) -> list[str]:
    changed = stale_files(site, files)
    for rel in changed:
        path = site / rel
        if rel not in files:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees a half-written page.
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(files[rel])
        os.replace(tmp.name, path)
    for path in sorted(site.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 listing stale files")
    parser.add_argument("--site", type=Path, default=DEFAULT_SITE,
                        help="output folder (default: site/)")
    args = parser.parse_args(argv)
    try:
        files = build_site(REPO)
    except ModuleNotFoundError as e:
        # The renderers are the `docs` extra, not runtime dependencies.
        print(f"build_docs.py: missing {e.name!r}; install the docs extra "
              "(`pip install -e '.[docs]'`, or `bash setup.sh test`)", file=sys.stderr)
        return 2
    if args.check:
        stale = stale_files(args.site, files)
        if stale:
            print(f"{args.site} is stale; run `python build_docs.py`. Stale files:")
            for rel in stale:
                print(f"  {rel}")
            return 1
        print(f"{args.site} is up to date ({len(files)} files)")
        return 0
    changed = write_site(args.site, files)
    print(f"wrote {len(changed)} of {len(files)} files to {args.site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
