"""
---
title: The reading order
summary: One list from which every page's place is rendered.
---

# The reading order

A learner reads the site from the home page to the last tooling page by the
previous/next links. The order is written once, in `docs_src/reading_order.txt`:
one page a line, `## Title` lines start a part, `@results` and `@glossary` are
the two pages the builder writes itself. The first part is the *core path*; a
page after it may name the core page it deepens, `page.py -> core_page.py`, and
the builder writes that as one line under the page's title. From it the builder
renders

* the previous/next chain (home page first, then every entry in order),
* the home page's list (where `index.md` says `{{reading_order}}`), by part,
* each folder index's list of its own pages, by title (where the package
  docstring says `{{contents}}`, or else appended after the docstring's
  introduction).

The build stops when a module of `labml_zero/` is missing from the file, listed
twice, or listed but gone, so that no page drops out of the chain unseen.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from .paths import BuildError, module_page, rel_href

ORDER_FILE = "docs_src/reading_order.txt"
GENERATED = {"@results": "results.html", "@glossary": "glossary.html"}


@dataclass(frozen=True)
class Part:
    title: str
    entries: tuple[str, ...]
    """Module paths (`labml_zero/zero3/chunk.py`) or `@results`/`@glossary`."""
    deepens: tuple[tuple[str, str], ...] = ()
    """(entry, the core page it deepens) for the entries written `a -> b`."""


def page_of(entry: str) -> str:
    """An entry of the order -> its site-relative page."""
    return GENERATED[entry] if entry in GENERATED else module_page(entry)


def parse_order(text: str) -> list[Part]:
    """The file's text -> its parts; entries before any `##` form an untitled part."""
    parts: list[tuple[str, list[str], list[tuple[str, str]]]] = [("", [], [])]
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("## "):
            parts.append((line[3:].strip(), [], []))
        elif line and not line.startswith("#"):
            entry, arrow, core = (x.strip() for x in line.partition("->"))
            parts[-1][1].append(entry)
            if arrow:
                parts[-1][2].append((entry, core))
    return [Part(t, tuple(e), tuple(d)) for t, e, d in parts if t or e]


def deepens(parts: list[Part]) -> dict[str, str]:
    """Each entry written `a -> b`: the core page `b` that page `a` deepens."""
    return {entry: core for part in parts for entry, core in part.deepens}


def load_order(root: Path, modules: list[str]) -> list[Part]:
    """
    Read and check the reading order against the modules that exist.

    Raises `BuildError` naming the module and the line to add or remove.
    """
    path = root / ORDER_FILE
    if not path.is_file():
        raise BuildError(f"{ORDER_FILE} is missing: it lists the pages in order")
    parts = parse_order(path.read_text(encoding="utf-8"))
    seen: set[str] = set()
    known = set(modules) | set(GENERATED)
    for part in parts:
        for entry in part.entries:
            if entry in seen:
                raise BuildError(f"{ORDER_FILE}: {entry} is listed twice")
            if entry not in known:
                raise BuildError(
                    f"{ORDER_FILE}: {entry} does not exist; remove its line")
            seen.add(entry)
    core = set(parts[0].entries) if parts else set()
    for entry, target in deepens(parts).items():
        if entry in core or target not in core:
            raise BuildError(
                f"{ORDER_FILE}: {entry} -> {target}: a page after the first part "
                "(the core path) names a page of that part")
    missing = [m for m in modules if m not in seen]
    if missing:
        raise BuildError(
            f"{missing[0]} has no place in the reading order: add it as one line "
            f"to {ORDER_FILE}, after the page whose terms it uses"
            + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
    return parts


def flat(parts: list[Part]) -> list[str]:
    return [entry for part in parts for entry in part.entries]


def _item(entry: str, from_page: str, titles: dict[str, tuple[str, str]]) -> str:
    title, summary = titles[entry]
    href = rel_href(page_of(entry), from_page)
    return f"1. [{title}]({href})" + (f": {summary}" if summary else "")


def _hover(summary: str) -> str:
    """A summary as a link's title: plain text, no Markdown, no quotes."""
    text = re.sub(r"[`*$]", "", " ".join(summary.split()))
    return text.replace("\\", "").replace('"', "'")


def _title_item(entry: str, from_page: str,
                titles: dict[str, tuple[str, str]]) -> str:
    """A page's title alone, its summary shown when the pointer rests on it."""
    title, summary = titles[entry]
    href = rel_href(page_of(entry), from_page)
    hover = f' "{_hover(summary)}"' if summary else ""
    return f"1. [{title}]({href}{hover})"


def home_list(parts: list[Part], titles: dict[str, tuple[str, str]]) -> str:
    """The home page's reading order, in Markdown, one numbered list per part."""
    out = []
    for part in parts:
        if part.title:
            out.append(f"### {part.title}\n")
        out.extend(_item(entry, "index.html", titles) for entry in part.entries)
        out.append("")
    return "\n".join(out).strip() + "\n"


def folder_list(
    parts: list[Part], package_init: str, titles: dict[str, tuple[str, str]]
) -> str:
    """
    A folder index's list: the pages directly in the folder and the index pages
    of its sub-folders, in reading order, by title. The home page lists every
    page with its summary; a folder page is read to find a page, and a list of
    titles is one screen where titles with their summaries were several.
    """
    folder = posixpath.dirname(package_init)
    children = []
    for entry in flat(parts):
        if entry == package_init or entry in GENERATED:
            continue
        parent = posixpath.dirname(entry)
        is_sub_index = (entry.endswith("/__init__.py")
                        and posixpath.dirname(parent) == folder)
        if parent == folder or is_sub_index:
            children.append(entry)
    page = module_page(package_init)
    return "\n".join(_title_item(e, page, titles) for e in children) + "\n"
