"""
---
title: Checks of the notes' text
summary: Raw TeX, long introductions, lab traces and unchecked numbers, with allowlists.
---

# Checks of the notes' text

The notes are a textbook. Eight checks read every page's notes (the Markdown, and
for raw TeX the built HTML) and list what a textbook should not have:

* **raw TeX**: a TeX command or a whole `$...$` left as text on a built page
  (the renderer already stops the build on one: this check reads every built
  page, the generated ones included), or a command spelled as letters inside a
  formula ("2times8": `\\times` written with two backslashes in a non-raw
  docstring);
* **introduction budget**: more than `INTRO_WORDS` words of prose (formulas and
  code not counted) in a module's introduction, its module docstring;
* **lab traces**: run IDs (`run18`), result file names, dates, "went from X to
  Y", and references to files outside the repository;
* **unchecked numbers**: a number of two or more digits, or with a decimal point,
  that neither a directive computes (`{{py: …}}`, `{{bench: …}}`) nor a named test
  asserts (`(tested: …)` right after it, or right after a formula, which it then
  vouches for whole). Single digits are counts in examples;
* **terms**: a glossary term used before the place that defines it, outside a
  `{{see: …}}` (the rule is on its own page, `docsite/terms.py`); this check
  has no allowlist: the notes have no such use.
* **names**: a backticked name, dotted path, call, flag or file that the code
  does not have, and **constants**: a constant of the code restated in a note
  instead of `{{const: NAME}}` (both on their own page, `docsite/code_refs.py`);
* **notation**: a page that gives a symbol of the notation table another
  meaning (`docsite/notation.py`).

Each check but terms, constants and notation (which have no finding) has an
allowlist in `docs_src/unchecked/` (one `page | finding` a line) holding what
the notes had when the check was written, so that CI stays
green while the notes are rewritten; the tests in `tests/docs/test_notes_lint.py`
fail on any finding not in its list. `python -m docsite.lint` prints each list's
size and its stale entries; `--write` rewrites the lists from the notes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from . import code_refs, notation, notes_beside_code, order, terms
from .directives import TESTED, strip_directives
from .glossary import GLOSSARY_FILE
from .markdown import TEX_LEFT, outside_code, visible_text
from .mathml import spelled_commands
from .paths import REPO, discover_modules
from .prose import DISPLAY, INLINE, intro_words, prose
from .results import load_results, results_markdown
from .site import build_site, load_pages

INTRO_WORDS = 600
UNCHECKED = "docs_src/unchecked"
CHECKS = ("raw_tex", "intro_budget", "lab_traces", "numbers", "terms", "names",
          "constants", "notation")
NO_ALLOWLIST = ("terms", "constants", "notation")

# Over the built pages: any TeX command, `$$`, or a `$...$` formula left as text.
RAW_TEX = TEX_LEFT
LAB_TRACES = [
    re.compile(r"\brun\d+\b"),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    re.compile(r"\bbench/results/\S+"),
    re.compile(r"\b[\w-]+\.(?:jsonl|log)\b"),
    re.compile(r"\b(?:went|gone|rose|fell|dropped|grew|improved|moved) from\b"
               r"[^.\n]{0,60}?\bto\b", re.I),
    re.compile(r"\bfrom \$?[\d.,]+\S* to \$?[\d.,]+", re.I),
    re.compile(r"ANCHORS\.md|\.\./shared"),
]
FORMULA_BEFORE = re.compile(r"(\$\$(?:(?!\$\$).)+\$\$|\$[^$\n]+\$)[\s.,;:]*$", re.S)
NUMBER = re.compile(r"(?<![\w.\-/\\^_])(?<!\^\{)(?<!_\{)(\d+(?:[.,]\d+)*)(?![\w.]?\d)")


def formulas(markdown: str) -> list[str]:
    text = prose(markdown)
    found = DISPLAY.findall(text)
    return found + INLINE.findall(DISPLAY.sub(" ", text))


def numbers(markdown: str) -> list[str]:
    """The numbers of a note that no directive computes and no test is named for."""
    # A `(tested: …)` vouches for the last number before it or, right after a
    # formula, for the whole formula: the test asserts the formula itself.
    def drop_tested(part: str) -> str:
        out, last = [], 0
        for m in TESTED.finditer(part):
            head = part[last:m.start()]
            formula = FORMULA_BEFORE.search(head)
            nums = list(NUMBER.finditer(head))
            if formula:
                head = head[:formula.start()] + " "
            elif nums:
                head = head[:nums[-1].start()] + head[nums[-1].end():]
            out.append(head)
            last = m.end()
        return "".join(out) + part[last:]

    text = prose(strip_directives(outside_code(markdown, drop_tested)))
    text = re.sub(r"^\s*\d+\.\s", " ", text, flags=re.M)  # list item numbers
    found = []
    for m in NUMBER.finditer(text):
        value = m.group(1)
        if len(value.replace(",", "").replace(".", "")) >= 2 or "." in value:
            found.append(value)
    return found


def findings(root: Path = REPO, site: dict[str, bytes] | None = None):
    """check -> sorted `page | finding` strings, over every module page."""
    modules = discover_modules(root)
    parts = order.load_order(root, modules)
    pages = load_pages(root, modules, parts, results_markdown(load_results(root)))
    out = {check: set() for check in CHECKS}
    for page in pages:
        if page.out in ("results.html", "glossary.html"):
            continue
        name = page.rel_py or "docs_src/index.md"
        docs = "\n\n".join(s.doc for s in page.sections)
        for latex in formulas(docs):
            for word in spelled_commands(latex):
                out["raw_tex"].add(f"{name} | spelled {word} in ${latex.strip()[:60]}$")
        if page.rel_py and page.sections and not page.sections[0].code:
            n = intro_words(page.sections[0].doc)
            if n > INTRO_WORDS:
                out["intro_budget"].add(f"{name} | {n} words")
        for pattern in LAB_TRACES:
            for m in pattern.finditer(strip_directives(docs)):
                out["lab_traces"].add(f"{name} | {' '.join(m.group(0).split())}")
        for value in numbers(docs):  # the home page's notes too
            out["numbers"].add(f"{name} | {value}")
        if site is not None and page.out in site:
            text = visible_text(site[page.out].decode("utf-8"))
            for m in RAW_TEX.finditer(text):
                out["raw_tex"].add(f"{name} | raw {' '.join(m.group(0).split())}")
    out["terms"].update(terms.check(root))
    notes = {p.rel_py or "docs_src/index.md": "\n\n".join(s.doc for s in p.sections)
             for p in pages if p.out not in ("results.html", "glossary.html")}
    notes[GLOSSARY_FILE] = (root / GLOSSARY_FILE).read_text(encoding="utf-8")
    for check, items in code_refs.Checker(root).check(notes).items():
        out[check].update(items)
    out["notation"].update(notation.check(root, notes))
    return {check: sorted(items) for check, items in out.items()}


def read_allowlist(root: Path, check: str) -> set[str]:
    path = root / UNCHECKED / f"{check}.txt"
    if check in NO_ALLOWLIST or not path.is_file():
        return set()
    return {line.strip() for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")}


HEADER = ("# Findings of the `{check}` check that the notes had when it was written "
          "(docsite/lint.py).\n# Remove a line when its page is rewritten; never "
          "add one.\n")


def main(argv: list[str]) -> int:
    found = findings(REPO, build_site(REPO))
    for check in CHECKS:
        allowed = read_allowlist(REPO, check)
        new = [f for f in found[check] if f not in allowed]
        stale = sorted(allowed - set(found[check]))
        print(f"{check}: {len(found[check])} findings, {len(allowed)} allowed, "
              f"{len(new)} new, {len(stale)} stale")
        for item in new:
            print(f"  new: {item}")
        for item in stale:
            print(f"  stale: {item}")
        if "--write" in argv and check not in NO_ALLOWLIST:
            path = REPO / UNCHECKED / f"{check}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(HEADER.format(check=check)
                            + "".join(f"{f}\n" for f in found[check]),
                            encoding="utf-8")
    print("\n".join(notes_beside_code.summary_lines(notes_beside_code.measure(REPO))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
