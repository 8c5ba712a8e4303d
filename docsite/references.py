"""
---
title: References as links
summary: The first mention on a page of a paper or project the notes build on
  links to it.
---

# References as links

The notes name the papers and projects they build on (the ZeRO paper, ZeRO-Offload
and ZeRO-Infinity, PatrickStar, ColossalAI's Gemini, labml-nn's annotated
implementations). On every page the first mention of each becomes a link to it,
so no page names a source a reader cannot reach; later mentions stay plain text.
A mention inside code, a heading or a link of its own is left as it is.
"""

from __future__ import annotations

import re

# (pattern of a mention, where it leads), most specific first.
REFERENCES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\bZeRO-Offload\b"), "https://arxiv.org/abs/2101.06840"),
    (re.compile(r"\bZeRO-Infinity\b"), "https://arxiv.org/abs/2104.07857"),
    (re.compile(r"\b(?:the )?ZeRO paper\b"), "https://arxiv.org/abs/1910.02054"),
    (re.compile(r"\bPatrickStar\b"), "https://arxiv.org/abs/2108.05818"),
    (re.compile(r"\bGemini\b"),
     "https://colossalai.org/docs/advanced_tutorials/meet_gemini"),
    (re.compile(r"\bColossalAI\b"), "https://github.com/hpcaitech/ColossalAI"),
    (re.compile(r"\blabml-nn\b"),
     "https://github.com/labmlai/annotated_deep_learning_paper_implementations"),
]
URLS = {url for _, url in REFERENCES}

# What a mention must not be inside: a Markdown link, an HTML tag, a heading line.
SKIP = re.compile(r"\[[^\]\n]*\]\([^)\n]*\)|<[^>\n]*>|^[ \t]*#{1,6}[ \t].*$", re.M)


def link_references(text: str, cited: set[str]) -> str:
    """Link each reference's first mention not yet in `cited`; add it there."""
    parts = SKIP.split(text)
    skipped = SKIP.findall(text)
    out = []
    for i, part in enumerate(parts):
        for pattern, url in REFERENCES:
            if url in cited:
                continue
            match = pattern.search(part)
            if match:
                cited.add(url)
                part = (part[:match.start()] + f"[{match.group(0)}]({url})"
                        + part[match.end():])
        out.append(part)
        if i < len(skipped):
            # an existing link to a reference counts as its citation
            cited.update(u for u in URLS if u in skipped[i])
            out.append(skipped[i])
    return "".join(out)


__all__ = ["REFERENCES", "link_references"]
