r"""
---
title: Math as MathML
summary: TeX becomes MathML at build time; what cannot stops the build.
---

# Math as MathML

Inline math is `$...$`, display math `$$...$$`; both become MathML at build time
(latex2mathml), which browsers render natively with the math font the site ships
(`static/fonts/latinmodern-math.otf`), so a page needs no script.

Aligned rows are written `$$\begin{aligned} a &= b \\ c &= d \end{aligned}$$`.
Numbered environments (`align`, `equation`, `eqnarray`) are refused: a page has
nothing to refer to by number. A formula latex2mathml does not understand, a
command it passes through untranslated (`\foo` shown as "\foo"), or a stray `&`
outside `aligned` stops the build with the page and the formula. So do two
slips that render without error but wrongly:

* a control character (a tab, a backspace) in a formula: a docstring that is not
  raw read `\text` as a tab and "ext" (make the docstring raw);
* a name of three or more lower-case letters set as a product of italic letters
  (`min` reads as m·i·n): write `\text{min}`, `\min` or `\operatorname{…}`.
"""

from __future__ import annotations

import re

from .paths import BuildError

REFUSED_ENV = re.compile(r"\\begin\{(align|equation|eqnarray|gather|multline)\*?\}")
UNTRANSLATED = re.compile(r"<(mi|mo|mtext)>\\[A-Za-z]+")
STRAY_AMP = re.compile(r"<mi>&(amp;)?</mi>")
TEXT_GROUP = re.compile(
    r"\\(text|mathrm|operatorname|texttt|mathtt|textrm|mbox)\s*\{[^{}]*\}")
# Command names that, written without their backslash (or after a `\\` that a
# non-raw docstring did not unescape), render as words: "2times8", "approx".
COMMAND_WORDS = (
    "times|approx|cdot|cdots|ldots|frac|sqrt|sum|prod|leq|geq|neq|infty|lceil|"
    "rceil|lfloor|rfloor|alpha|beta|gamma|delta|epsilon|lambda|sigma|Psi|ln|log|"
    "exp|mathrm|quad|leftarrow|rightarrow"
)
SPELLED = re.compile(rf"(?<![\\A-Za-z])({COMMAND_WORDS})(?![A-Za-z])")
DOUBLE_BACKSLASH_WORD = re.compile(r"\\\\[A-Za-z]+")
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f]")
# three or more single lower-case italic letters in a row: a word set as a product
ITALIC_WORD = re.compile(r"(?:<mi>[a-z]</mi>){3,}")


def to_mathml(latex: str, *, display: bool, where: str) -> str:
    """One formula -> MathML; `where` (the page) names it in errors."""
    from latex2mathml.converter import convert

    if CONTROL.search(latex):
        raise BuildError(
            f"{where}: control character {CONTROL.search(latex).group(0)!r} in "
            f"{latex!r}; a docstring that is not raw ate a backslash (make it raw)")
    if REFUSED_ENV.search(latex):
        raise BuildError(
            f"{where}: numbered environment in {latex} ; write "
            r"$$\begin{aligned} ... \end{aligned}$$")
    # latex2mathml knows `align*` (an unnumbered table of rows), not `aligned`,
    # and passes `\arg` through untranslated: it is an operator name.
    converted = re.sub(r"\\(begin|end)\{aligned\}", r"\\\1{align*}", latex)
    converted = re.sub(r"\\arg(?![A-Za-z])", r"\\operatorname{arg}", converted)
    try:
        mathml = convert(converted, display="block" if display else "inline")
    except Exception as exc:  # noqa: BLE001 -- any failure is the formula's
        raise BuildError(f"{where}: formula does not convert ({exc}): {latex}")
    bad = UNTRANSLATED.search(mathml)
    if bad:
        raise BuildError(
            f"{where}: unsupported TeX '{bad.group(0).split('>')[1]}' in {latex}")
    word = ITALIC_WORD.search(mathml)
    if word:
        name = "".join(re.findall(r"<mi>([a-z])</mi>", word.group(0)))
        raise BuildError(
            f"{where}: '{name}' set as a product of italic letters in {latex}; "
            rf"write \text{{{name}}} (or \{name} for a function like \min)")
    if STRAY_AMP.search(mathml):
        raise BuildError(f"{where}: '&' outside aligned rows in {latex}")
    # latex2mathml keeps the escapes of `\text{prefetch\_depth}` in its <mtext>.
    return re.sub(
        r"<mtext>(.*?)</mtext>",
        lambda m: "<mtext>" + re.sub(r"\\([_%&#$])", r"\1", m.group(1)) + "</mtext>",
        mathml,
    )


def spelled_commands(latex: str) -> list[str]:
    r"""
    TeX commands that would render as letters: `times` without its backslash, or
    `\\times` (a non-raw docstring's escaped backslash, shown as typed).
    """
    found = DOUBLE_BACKSLASH_WORD.findall(latex)
    # `\\` followed by a space or a newline is a row break in aligned rows: fine.
    text = TEXT_GROUP.sub(" ", DOUBLE_BACKSLASH_WORD.sub(" ", latex))
    text = re.sub(r"\\[A-Za-z]+", " ", text)
    found += SPELLED.findall(text)
    return found
