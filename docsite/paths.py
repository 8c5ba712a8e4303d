"""
---
title: Pages and their addresses
summary: Where each module's page lives in the site, and relative links between pages.
---

# Pages and their addresses

Every module `labml_zero/a/b.py` is the page `labml_zero/a/b.html`, a package's
`__init__.py` is its folder's `index.html`, and the whole file, highlighted, is
`source/labml_zero/a/b.py.html`. Links between pages are relative, so the site
works from `file://` as well as from any web server.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "labml_zero"
DEFAULT_SITE = REPO / "site"


class BuildError(Exception):
    """A problem in the sources that must stop the build: the message names it."""


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


def discover_modules(root: Path) -> list[str]:
    pkg = root / PACKAGE
    found = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel.split("/"):
            continue
        found.append(rel)
    return sorted(found)
