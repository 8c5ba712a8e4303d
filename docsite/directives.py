"""
---
title: Directives in the notes
summary: Numbers from the code, measured figures, terms, tested numbers.
---

# Directives in the notes

A number stated in a note should come from somewhere a reader can check. The
builder expands six directives, anywhere in notes outside code (not inside
`$...$`: write the directive next to the formula):

* `{{py: memory_model.bytes_per_param(...) | ,}}` evaluates a Python expression
  against the modules of `PY_NAMESPACE` when the site is built. The expression may
  only name those modules, call functions, read public attributes and do
  arithmetic; after `|` comes a format spec (`,`, `.1f`, `.3g`). Integers default
  to `,` (thousands separators); floats must give a format, so that the page's
  digits are chosen, not whatever `repr` gives.
* `{{const: BACKWARD_EXTRA_UNITS}}` shows a constant of the code as
  `BACKWARD_EXTRA_UNITS = 0`, its value read from the code when the site is
  built (`memory_model.BACKWARD_EXTRA_UNITS` when two modules assign the name);
  a note that restates a constant in backticks is a finding
  (`docsite/code_refs.py`).
* `{{bench: W2 labml_zero tokens_per_s}}` inserts a measured figure from the
  Results page and links to its row (see `docsite/results.py`).
* `{{term: gather stream}}` marks the place that defines a term: the words
  show in bold and the glossary links to them. `{{term: shards | shard}}` shows
  "shards" and defines "shard".
* `{{see: gather stream}}` (or `{{see: gather streams | gather stream}}`) is a
  use of a term before the page that defines it: the words link to the
  definition, with the glossary's one-line meaning as their hover title
  (`docsite/terms.py` lists every other such early use).
* `(tested: tests/zero3/test_chunk.py::test_gather)` says that the number just
  before it is asserted by that test; the page shows a small check mark after
  the sentence, linking to the test's code (`docsite/citations.py`); the build
  stops when the file or the test function does not exist.

Any other number in a note is listed by `tests/docs/test_notes_lint.py` (with the
allowlist `docs_src/unchecked/numbers.txt` for the notes not rewritten yet).
"""

from __future__ import annotations

import ast
import html
import importlib
import re
from pathlib import Path

from .citations import TESTED, TestIndex, place_citations
from .code_index import CodeIndex
from .code_refs import CONST, expand_constants
from . import calculator
from .paths import BuildError, rel_href, slugify
from .results import lookup

PY_NAMESPACE = {
    "memory_model": "labml_zero.planner.memory_model",
    "memory_budget": "labml_zero.planner.memory_budget",
    "families": "labml_zero.families",
    "hybrid_memory": "labml_zero.planner.hybrid_memory",
    "chunk_layout": "labml_zero.zero3.chunk_layout",
    "chunk_search": "labml_zero.planner.chunk_search",
    "zero_config": "labml_zero.zero3.config",
    "neox_model": "labml_zero.neox.model",
    "activation_memory": "labml_zero.neox.activation_memory",
    "llama_activations": "labml_zero.llama.activation_memory",
    "llama_config": "labml_zero.llama.config",
    "llama_kernels": "labml_zero.llama.kernels",
    "neox_kernels": "labml_zero.neox.kernels",
    "app": "labml_zero.app.server",
    "finetuners": "labml_zero.neox.finetuners",
    "rounded_update": "labml_zero.optimizers.rounded_update",
    "blockwise_moments": "labml_zero.optimizers.blockwise_moments",
    "state_layout": "labml_zero.zero3.state_layout",
    "step_time": "labml_zero.planner.step_time",
    "workloads": "bench.workloads",
    "math": "math",
}
"""Names a `{{py: …}}` expression may use, and the module each one is."""

PY = re.compile(r"\{\{py:\s*(.+?)\s*\}\}", re.S)
BENCH = re.compile(r"\{\{bench:\s*(.+?)\s*\}\}")
TERM = re.compile(r"\{\{term:\s*([^{}|]+?)\s*(?:\|\s*([^{}]+?)\s*)?\}\}")
SEE = re.compile(r"\{\{see:\s*([^{}|]+?)\s*(?:\|\s*([^{}]+?)\s*)?\}\}")
ANY = re.compile(r"\{\{(py|bench|term|see|const):.*?\}\}|\(tested:[^)]*\)", re.S)

_ALLOWED = (
    ast.Expression, ast.Call, ast.Attribute, ast.Name, ast.Load, ast.Constant,
    ast.keyword, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div,
    ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Tuple, ast.List,
    ast.Subscript, ast.Slice,
)


def evaluate(expr: str, where: str):
    """Evaluate a `{{py: …}}` expression in the whitelisted namespace."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise BuildError(f"{where}: {{{{py: {expr}}}}} does not parse ({exc.msg})")
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise BuildError(f"{where}: {{{{py: {expr}}}}} uses "
                             f"{type(node).__name__}, which is not allowed")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise BuildError(f"{where}: {{{{py: {expr}}}}} reads private {node.attr}")
        if isinstance(node, ast.Name):
            if node.id not in PY_NAMESPACE:
                raise BuildError(f"{where}: {{{{py: {expr}}}}}: {node.id!r} is not "
                                 f"one of {', '.join(sorted(PY_NAMESPACE))}")
            names.add(node.id)
    namespace = {n: importlib.import_module(PY_NAMESPACE[n]) for n in sorted(names)}
    try:
        return eval(compile(tree, "<py directive>", "eval"),  # noqa: S307
                    {"__builtins__": {}}, namespace)
    except Exception as exc:  # noqa: BLE001 -- name the page and the expression
        raise BuildError(f"{where}: {{{{py: {expr}}}}} failed: "
                         f"{type(exc).__name__}: {exc}")


def format_value(value, spec: str | None, where: str, expr: str) -> str:
    if spec is None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise BuildError(f"{where}: {{{{py: {expr}}}}} gives "
                             f"{type(value).__name__}; give a number or a string")
        if isinstance(value, float):
            raise BuildError(f"{where}: {{{{py: {expr}}}}} is a float; give a "
                             "format after '|', such as '| .2f'")
        spec = "," if isinstance(value, int) else ""
    try:
        return format(value, spec)
    except (ValueError, TypeError) as exc:
        raise BuildError(f"{where}: {{{{py: {expr}}}}}: bad format {spec!r} ({exc})")


class Directives:
    """
    Expands the directives of one site; `results` is `load_results(root)`,
    `definitions` the glossary's slug -> `Definition` (where `{{see:}}` links)
    and `meanings` its slug -> (term, meaning) (the links' hover titles).
    """

    def __init__(self, root: Path, results: dict, results_page: str = "results.html",
                 *, definitions: dict | None = None, meanings: dict | None = None):
        self.root = root
        self.results = results
        self.results_page = results_page
        self.definitions = definitions or {}
        self.meanings = meanings or {}
        self.tests = TestIndex(root)
        self.code = None  # the CodeIndex, read on the first `{{const: …}}`

    def expand(self, text: str, page: str) -> str:
        def py(match: re.Match) -> str:
            expr, _, spec = match.group(1).partition("|")
            expr = expr.strip()
            value = evaluate(expr, page)
            spec = spec.strip() if _ else None
            return html.escape(format_value(value, spec, page, expr))

        def bench(match: re.Match) -> str:
            try:
                value, key = lookup(self.results, match.group(1))
            except BuildError as exc:
                raise BuildError(f"{page}: {exc}")
            href = rel_href(self.results_page, page) + f"#{key.anchor}"
            return f'<a class="measured" href="{href}">{html.escape(value)}</a>'

        def term(match: re.Match) -> str:
            shown = match.group(1)
            slug = slugify(match.group(2) or shown)
            return f'<dfn id="term-{slug}">{html.escape(shown)}</dfn>'

        def see(match: re.Match) -> str:
            shown = match.group(1)
            slug = slugify(match.group(2) or shown)
            d = self.definitions.get(slug)
            if d is None:
                raise BuildError(f"{page}: {match.group(0)}: no page defines "
                                 f"{(match.group(2) or shown)!r} with {{{{term: …}}}}")
            href = html.escape(f"{rel_href(d.page, page)}#term-{slug}")
            meaning = self.meanings.get(slug, ("", ""))[1].replace("$", "")
            title = f' title="{html.escape(meaning)}"' if meaning else ""
            return f'<a class="term-ref" href="{href}"{title}>{html.escape(shown)}</a>'

        if CONST.search(text):
            if self.code is None:
                self.code = CodeIndex(self.root)
            text = expand_constants(text, page, self.code)
        text = calculator.expand(text, page)
        text = PY.sub(py, text)
        text = BENCH.sub(bench, text)
        text = TERM.sub(term, text)
        return SEE.sub(see, text)

    def cite(self, text: str, page: str) -> str:
        """A whole note's `(tested: …)` tags as marks after their sentences."""
        return place_citations(text, page, self.tests)


def term_definitions(text: str) -> list[tuple[str, str]]:
    """`(shown words, slug)` of every `{{term: …}}` in a note's Markdown."""
    return [(m.group(1), slugify(m.group(2) or m.group(1)))
            for m in TERM.finditer(text)]


def strip_directives(text: str) -> str:
    """A note's Markdown without its directives (what the number lint reads)."""
    return ANY.sub(" ", text)
