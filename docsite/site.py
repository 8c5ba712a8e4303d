"""
---
title: Building the site
summary: Every page in reading order into one template, deterministically.
---

# Building the site

`build_site(root)` returns every file of the site by its site-relative path:
the static files (CSS, the math font), the figures, one page per module in the
reading order, the Results page and the glossary, and one highlighted source page
per module and per file of `tests/` (the notes' check marks link to the tests). Nothing depends on the clock, the machine or the order files are
found in, so the same sources give byte-identical output and `--check` can
compare a committed `site/` with a fresh build.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import glossary, notation, order
from .citations import test_files
from .directives import Directives, term_definitions
from .markdown import NOTE_HEADING, Renderer, highlight, link_code_notes, source_html
from .paths import (PACKAGE, REPO, BuildError, discover_modules, module_page,
                    rel_href, slugify, source_page)
from .results import READER_INTRO as RESULTS_INTRO
from .results import load_results, results_markdown, results_rows
from .snippets import code_of
from .split import Section, SplitModule, parse_front_matter, split_source


@dataclass
class Page:
    rel_py: str | None  # None for the home page and the generated pages
    out: str
    title: str
    summary: str
    sections: list[Section]
    error: str = ""
    code_files: dict[int, str] = field(default_factory=dict)
    """A generated page's rows' code: row index -> the file it comes from (a
    module page's code is its own file's)."""


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
    return Page(rel_py, module_page(rel_py), title or rel_py,
                split.front.get("summary", ""), split.sections, error)


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
    diagrams = _load_path("_labml_zero_diagrams", root / "docs_src" / "diagrams.py")
    figures_src = root / "docs_src" / "figures"
    out: dict[str, bytes] = {}
    trace_path = figures_src / "step_timeline.json"
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    # every figure drawn from the code and the measured trace, by site path
    drawn = diagrams.figures(root, trace, where=str(trace_path.relative_to(root)))
    out.update({path: svg.encode() for path, svg in drawn.items()})
    # Hand-drawn figures dropped into docs_src/figures/ are copied as they are.
    for path in sorted(figures_src.iterdir()):
        if path.suffix in {".svg", ".png"} and f"figures/{path.name}" not in out:
            out[f"figures/{path.name}"] = path.read_bytes()
    return out


def static_files(docs_src: Path) -> dict[str, bytes]:
    from pygments.formatters import HtmlFormatter

    out = {}
    static = docs_src / "static"
    for path in sorted(static.rglob("*")):
        if path.is_file():
            out[f"static/{path.relative_to(static).as_posix()}"] = path.read_bytes()
    out["static/pygments.css"] = (
        HtmlFormatter(style="default").get_style_defs(".highlight") + "\n"
    ).encode()
    return out


def _crumbs(page: Page, by_py: dict[str, Page]) -> list[dict]:
    crumbs = [{"href": rel_href("index.html", page.out), "title": "Home"}]
    if not page.rel_py:
        if page.out != "index.html":
            crumbs.append({"href": "", "title": page.title})
        return crumbs
    parts = page.rel_py.split("/")
    for d in range(1, len(parts)):
        pkg_page = by_py.get("/".join(parts[:d]) + "/__init__.py")
        href = ""
        if pkg_page is not None and pkg_page is not page:
            href = rel_href(pkg_page.out, page.out)
        crumbs.append({"href": href, "title": parts[d - 1]})
    if not page.rel_py.endswith("__init__.py"):
        crumbs.append({"href": "", "title": parts[-1]})
    return crumbs


def _with_contents(page: Page, listing: str) -> list[Section]:
    """A folder index with its list of pages, where `{{contents}}` says or after
    the introduction."""
    block = "## Pages in this folder\n\n" + listing
    sections = list(page.sections)
    for i, s in enumerate(sections):
        if "{{contents}}" in s.doc:
            sections[i] = Section(s.doc.replace("{{contents}}", listing),
                                  s.code, s.lineno)
            return sections
    at = 1 if sections and not sections[0].code else 0
    return sections[:at] + [Section(block, "", 0)] + sections[at:]


def _with_deepens(page: Page, core: str, titles: dict[str, tuple[str, str]]
                  ) -> list[Section]:
    """The line under a page's title that names the core page it deepens."""
    href = rel_href(order.page_of(core), page.out)
    line = f"*Deepens the core path's [{titles[core][0]}]({href}).*"
    sections = list(page.sections)
    for i, s in enumerate(sections):
        title = re.search(r"^#[ \t]+.+$", s.doc, re.M)
        if title:
            doc = s.doc[:title.end()] + "\n\n" + line + s.doc[title.end():]
            sections[i] = Section(doc, s.code, s.lineno)
            return sections
    return [Section(line, "", 0)] + sections


def load_pages(root: Path, modules: list[str], parts: list[order.Part],
               results_md: str) -> list[Page]:
    """The home page, then every entry of the reading order, contents filled in."""
    docs_src = root / "docs_src"
    index_text = (docs_src / "index.md").read_text(encoding="utf-8")
    front, body = parse_front_matter(index_text)
    home = Page(None, "index.html", front.get("title", PACKAGE),
                front.get("summary", ""), [Section(body, "", 0)])
    pages = [home]
    for entry in order.flat(parts):
        if entry == "@results":
            pages.append(Page(None, "results.html", "Results",
                              "Measured throughput and memory of every engine and "
                              "workload, from bench/results.",
                              [Section("# Results\n\n" + results_md, "", 0)]))
        elif entry == "@glossary":
            pages.append(Page(None, "glossary.html", "Glossary",
                              "Each term and the note that defines it.", []))
        else:
            pages.append(load_module_page(root, entry))
    titles = {}
    for entry, page in zip(order.flat(parts), pages[1:]):
        titles[entry] = (page.title, page.summary)
    deepened = order.deepens(parts)
    for entry, page in zip(order.flat(parts), pages[1:]):
        if entry in deepened:
            page.sections = _with_deepens(page, deepened[entry], titles)
        # The package's own page is the core path's overview; the home page
        # lists every page, so it lists no folder of its own.
        if entry.endswith("/__init__.py") and entry != f"{PACKAGE}/__init__.py":
            page.sections = _with_contents(page,
                                           order.folder_list(parts, entry, titles))
    listing = order.home_list(parts, titles)
    home.sections = [Section(body.replace("{{reading_order}}", listing), "", 0)]
    return pages


def _source_page(template, root: Path, rel: str, notes_page: str | None) -> bytes:
    """A whole file highlighted, one anchor per line; `notes_page` is its page."""
    page_out = source_page(rel)
    home = rel_href("index.html", page_out)
    crumbs = [{"href": home, "title": "Home"}]
    if notes_page:
        crumbs.append({"href": rel_href(notes_page, page_out), "title": rel})
        crumbs.append({"href": "", "title": "source"})
    else:
        crumbs.append({"href": "", "title": rel})
    context = {
        "title": rel,
        "summary": f"Source of {rel}",
        "home": False,
        "prose": False,
        "root": home.rsplit("index.html", 1)[0],
        "crumbs": crumbs,
        "prev": None,
        "next": None,
        "lines": source_html((root / rel).read_text(encoding="utf-8")),
    }
    return template.render(kind="source", **context).encode()


def _results_beside_code(root: Path, page: Page, results) -> None:
    """The Results page as rows, each note beside the code it explains."""
    page.sections = [Section("# Results\n\n" + RESULTS_INTRO, "", 0)]
    page.code_files = {}
    for doc, file, name, lines, start in results_rows(results):
        snippet = code_of(root, file, name, lines, start) if file else None
        if snippet is None:
            page.sections.append(Section(doc, "", 0))
            continue
        page.code_files[len(page.sections)] = file
        page.sections.append(Section(doc, snippet.code, snippet.lineno))


def build_site(root: Path = REPO) -> dict[str, bytes]:
    """Every file of the site, by site-relative path."""
    import jinja2

    docs_src = root / "docs_src"
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(docs_src / "templates")),
        autoescape=jinja2.select_autoescape(["html"]),
        keep_trailing_newline=True,
    )
    template = env.get_template("page.html")

    out = static_files(docs_src)
    figures = build_figures(root)
    out.update(figures)

    modules = discover_modules(root)
    parts = order.load_order(root, modules)
    results = load_results(root)
    pages = load_pages(root, modules, parts, results_markdown(results))
    by_py = {p.rel_py: p for p in pages if p.rel_py}
    for page in pages:
        if page.out == "results.html":
            _results_beside_code(root, page, results)

    files = set(out) | {p.out for p in pages}
    files |= {source_page(m) for m in modules + test_files(root)}

    notes: dict[str, list[str]] = {}
    page_notes: dict[str, set[str]] = {}
    defs: dict[str, glossary.Definition] = {}
    for page in pages:
        slugs = set()
        for k, section in enumerate(page.sections):
            for name in NOTE_HEADING.findall(section.doc):
                slugs.add(slugify(name))
            for shown, slug in term_definitions(section.doc):
                glossary.add_definition(defs, slug, glossary.Definition(
                    shown, page.out, page.title,
                    page.code_files.get(k, page.rel_py or "") if section.code
                    else "", section.code, section.lineno))
        page_notes[page.out] = slugs
        for slug in sorted(slugs):
            notes.setdefault(slug, []).append(page.out)
    meanings = glossary.read_meanings(root)
    for page in pages:
        if page.out == "glossary.html":
            rows = glossary.glossary_rows(root, meanings, defs, page.out)
            # the notation is a table a reader looks a symbol up in, like the
            # Results page's tables: a figure, not notes
            table = ("<figure class=\"data\">\n\n" + notation.table_markdown(
                notation.read_table(root)) + "\n</figure>")
            page.sections = ([Section("# Glossary\n\n" + glossary.READER_INTRO,
                                      "", 0)] + [row for row, _ in rows]
                             + [Section(table, "", 0)])
            page.code_files = {k: f for k, (_, f) in enumerate(rows, 1) if f}
    code_files = sorted({f for p in pages for f in p.code_files.values()}
                        - set(modules) - set(test_files(root)))
    files |= {source_page(f) for f in code_files}

    directives = Directives(root, results, definitions=defs, meanings=meanings)
    renderer = Renderer(files, notes, figures=figures, directives=directives)
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
            code_file = page.code_files.get(k, page.rel_py)
            if section.code and code_file:
                src_page = rel_href(source_page(code_file), page.out)
                src = f"{src_page}#L{section.lineno}"
            rows.append({"id": f"section-{k}", "doc": doc_html, "code": code_html,
                         "lineno": section.lineno, "src": src,
                         "file": code_file or "",
                         "figures": list(renderer.figures)})

        context = {
            "title": page.title,
            "summary": page.summary,
            "home": page.out == "index.html",
            # a generated page whose rows sit beside code is laid out as notes
            "prose": page.rel_py is None and not page.code_files,
            "root": rel_href("index.html", page.out).rsplit("index.html", 1)[0],
            "crumbs": _crumbs(page, by_py),
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
        out[source_page(rel)] = _source_page(template, root, rel, module_page(rel))
    # The tests, which the notes' check marks link to, outside the reading order,
    # and the files whose code the generated pages show.
    for rel in test_files(root) + code_files:
        out[source_page(rel)] = _source_page(template, root, rel, None)

    if renderer.unresolved:
        # Every "Note: …" is a link to its anchor, or the build stops.
        raise BuildError("\n".join(sorted(set(renderer.unresolved))))
    for warning in sorted(set(renderer.warnings)):
        print(f"warning: {warning}", file=sys.stderr)
    return dict(sorted(out.items()))


__all__ = ["BuildError", "Page", "build_site", "load_module_page", "load_pages"]
