"""Helpers for the small source trees the builder's tests build."""

from __future__ import annotations

import re
from pathlib import Path


def without_code_quotes(docs_src: Path) -> None:
    """Drop the `@ file.py:name` quotes from a copied glossary and notation: a
    test tree holds little or none of the code they name."""
    for name in ("glossary.txt", "notation.txt"):
        path = docs_src / name
        path.write_text(re.sub(r" (\| )?@ .*", "", path.read_text()))
