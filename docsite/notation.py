r"""
---
title: One meaning per symbol
summary: The book's notation table, shown on the glossary page, and the check that no page gives a listed symbol another meaning.
---

# One meaning per symbol

`docs_src/notation.txt` lists the symbols the book uses across pages, one a
line: `$symbol$ | meaning | words`. The meaning is what the glossary page shows;
the words (stems, any case) are the ones a definition of that symbol uses: the
optimizer's bytes $K$ is defined with "optimizer", "Adam", "master" or
"moment", never with "rank".

The check reads every page's notes (prose, with each formula kept whole) and
finds where a page says what a listed symbol is, in one of four ways:

* "$K$ is / means / denotes / counts the …" and "where $K$ is the …";
* an apposition or a parenthesis right after it: "$S$, the shard's …",
  "$S$ (the loss scale)", "$g_r$: the reduce dtype's bytes";
* a noun phrase right before it: "the loss scale $S$", "a shard of $S$";
* a unit right after it: "$K$ ranks", "$S$ times larger", "$N_d$ shards".

What the page says there must contain one of the symbol's words, else it is a
finding, `page | $S$ "loss scale" (notation: a shard's elements)`: a second
meaning for a listed symbol. A symbol the table does not list is the page's own
(its definition is not checked), so a page may name a local quantity, but not
with a listed symbol.

## Limitations

* The words decide, not the sense: a definition that reuses a listed symbol with
  one of its words ("the optimizer's ranks $K$") passes.
* Only the four forms above are read; a symbol given a meaning in any other
  phrasing is not seen.
* Another symbol for a listed quantity ($N$ for the ranks) is not caught: the
  check knows the listed symbols, not every way to name their quantities.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .markdown import outside_code
from .paths import BuildError

NOTATION_FILE = "docs_src/notation.txt"
UNITS = ("ranks", "rank", "elements", "element", "bytes", "byte", "parameters",
         "tokens", "steps", "layers", "groups", "chunks", "units", "GPUs", "hosts",
         "replicas", "shards", "seconds", "dimensions", "heads")
_FORMULA = re.compile(r"\$\$.+?\$\$|(?<![\\$])\$[^$\n]+?\$", re.S)
_VERB = re.compile(r"\s*(?:is|are|means|denotes|counts|stands for)\s+((?:the|a|an|its|"
                   r"their)\s[^.;:()$]{1,80})")
_APPOSITION = re.compile(r"\s*(,|:|\()\s*((?:the|a|an|its|their)\s[^.;:()$]{1,80})")
# a unit right after, or one or two qualifiers and a unit: "$\Psi$ trainable
# parameters"; and "$D$ = `prefetch_depth`", a symbol equated with a name
_UNIT = re.compile(rf"[ \t]+((?:[\w-]+[ \t]+){{0,2}}(?:{'|'.join(UNITS)}))\b")
_EQUALS = re.compile(r"[ \t]*=[ \t]*([A-Za-z][\w ]{1,60}?)(?=[;,.)]|$)")
_BEFORE = re.compile(r"\b(?:the|a|an|its|their|each|every)\s+((?:[\w-]+\s+){0,3}"
                     r"[\w-]+)\s*$", re.I)
# A phrase with one of these before the symbol is not a name for it ("of the
# $N_d$ ranks", "splits into $N_d$"): only a bare noun phrase is.
_NOT_A_NAME = re.compile(
    r"\b(?:of|into|by|is|are|was|be|to|and|or|over|with|in|on|at|for|from|than|as|"
    r"per|one|two|all|same|other|first|last|next|multiple|divide|divides|split|"
    r"splits|moves|runs|saves|holds|takes|gives|costs|has|have|its|their|this|that|"
    r"these|those|which|whose|times|only|also|then)\b", re.I)


@dataclass(frozen=True)
class Symbol:
    tex: str       # as written between the dollars, normalised
    meaning: str   # what the glossary page shows
    words: tuple[str, ...]


def normalise(tex: str) -> str:
    """`N_{d}` and `N_d`, `\\Psi_{t}` and `\\Psi_t` are the same symbol."""
    tex = re.sub(r"\s+", "", tex)
    return re.sub(r"_\{(\w)\}", r"_\1", tex)


def read_table(root: Path) -> list[Symbol]:
    path = root / NOTATION_FILE
    if not path.is_file():
        return []
    out, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(" | ")]
        if len(fields) != 3 or not re.fullmatch(r"\$[^$]+\$", fields[0]):
            raise BuildError(f"{NOTATION_FILE}:{n}: write '$symbol$ | meaning | "
                             "word, word'")
        tex = normalise(fields[0][1:-1])
        if tex in seen:
            raise BuildError(f"{NOTATION_FILE}:{n}: ${tex}$ is listed twice; a "
                             "symbol has one meaning")
        seen.add(tex)
        words = tuple(w.strip().lower() for w in fields[2].split(",") if w.strip())
        out.append(Symbol(tex, fields[1], words))
    return out


def table_markdown(symbols: list[Symbol]) -> str:
    """The notation table of the glossary page."""
    rows = ["## Notation", "",
            "One symbol per quantity across the book: no page gives a symbol of "
            "this table another meaning.",
            "", "| symbol | meaning |", "| --- | --- |"]
    rows += [f"| ${s.tex}$ | {s.meaning} |" for s in symbols]
    return "\n".join(rows) + "\n"


def definitions(markdown: str) -> list[tuple[str, str]]:
    """(symbol, what the text says it is) for each place a note says it."""
    text = outside_code(markdown, lambda p: p)
    text = re.sub(r"`+([^`]*)`+", lambda m: m.group(1).replace("$", ""), text)
    text = re.sub(r"\{\{(?:see|term):\s*([^{}|]+?)\s*(?:\|[^{}]*)?\}\}", r"\1", text)
    text = re.sub(r"\{\{.*?\}\}|\(tested:[^)]*\)", " ", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)", "]", text).replace("[", "").replace("]", "")
    out = []
    for m in _FORMULA.finditer(text):
        if m.group(0).startswith("$$"):
            continue
        tex = normalise(m.group(0)[1:-1])
        # what follows, within its paragraph, on one line
        after = re.split(r"\n\s*\n", text[m.end():m.end() + 160])[0]
        after = " ".join(after.split(" \n")).replace("\n", " ")
        before = text[max(0, m.start() - 80):m.start()]
        where_is = re.search(r"\bwhere\s*$", before)
        line_start = re.search(r"(?:^|\n)[ \t]*(?:[*-][ \t]+)?$", before)
        for rule in (_VERB, _APPOSITION, _UNIT, _EQUALS):
            hit = rule.match(after)
            if not hit:
                continue
            if rule is _VERB and not where_is and before.rstrip().endswith(
                    ("of", "and", "by", "is", "to", "than", "with", "at")):
                continue
            # "$g_r$: the reduce dtype's bytes" names it only at a line's start
            if rule is _APPOSITION and hit.group(1) == ":" and not line_start:
                continue
            said = " ".join(hit.group(hit.lastindex).split())
            if rule is _UNIT and _NOT_A_NAME.search(said):
                continue  # "$p$ on one rank": a preposition, not a qualifier
            if rule is _EQUALS:
                said = said.replace("_", " ")  # `prefetch_depth` reads as words
            out.append((tex, said))
            break
        # the phrase before, within its sentence and paragraph
        before = re.split(r"[.;:!?()]\s|\n\s*\n|\$", before)[-1]
        hit = _BEFORE.search(before)
        multiplier = re.match(r"\s+times\b", after)  # "the cores $N_d$ times over"
        if hit and not multiplier and not _NOT_A_NAME.search(hit.group(1)):
            out.append((tex, " ".join(hit.group(1).split())))
    return out


def check(root: Path, notes: dict[str, str]) -> set[str]:
    """`page | finding` for each listed symbol given a meaning without its words."""
    table = {s.tex: s for s in read_table(root)}
    found = set()
    # A symbol's siblings share its letter ($\Psi$, $\Psi_t$, $\Psi_f$): a word
    # only a sibling has ("trainable") names the sibling, not this symbol.
    foreign = {}
    for s in table.values():
        base = s.tex.split("_")[0]
        others = {w for o in table.values() if o is not s
                  and o.tex.split("_")[0] == base for w in o.words}
        own = set(s.words) - others  # the words only this symbol has
        foreign[s.tex] = (others - set(s.words), own)
    for page, markdown in notes.items():
        for tex, said in definitions(markdown):
            symbol = table.get(tex)
            if symbol is None:
                continue
            low = said.lower()
            if not any(re.search(rf"\b{re.escape(w)}", low) for w in symbol.words):
                found.add(f'{page} | ${tex}$ "{said}" (notation: {symbol.meaning})')
            elif any(re.search(rf"\b{re.escape(w)}", low) for w in foreign[tex][0]
                     ) and not any(re.search(rf"\b{re.escape(w)}", low)
                                   for w in foreign[tex][1]):
                found.add(f'{page} | ${tex}$ "{said}" names another symbol '
                          f"(notation: {symbol.meaning})")
    return found
