"""
---
title: The prose of a note
summary: What a reader reads of a note - its Markdown without code, link targets
  and tags - and how many words that is.
---

# The prose of a note

The introduction budget (`docsite/lint.py`) and the notes-beside-code figures
(`docsite/notes_beside_code.py`) count words alike: prose only, a display formula
not at all and an inline formula as one word.
"""

from __future__ import annotations

import re

from .markdown import outside_code

DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE = re.compile(r"(?<![\\$\w])\$([^\s$](?:[^$\n]*?[^\s$\\])?)\$(?![\w$])")


def prose(markdown: str) -> str:
    """Markdown without code, link targets and HTML tags."""
    text = outside_code(markdown, lambda p: p)
    text = re.sub(r"^```.*?^```[ \t]*$", " ", text, flags=re.S | re.M)
    text = re.sub(r"`+[^`]*`+", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<[^>]+>", " ", text)


def intro_words(markdown: str) -> int:
    text = DISPLAY.sub(" ", prose(markdown))
    text = INLINE.sub(" x ", text)
    return len(re.findall(r"[A-Za-z0-9][\w'’-]*", text))
