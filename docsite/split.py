"""
---
title: Splitting a module into notes and code
summary: How a Python file becomes the rows of a two-column page.
---

# Splitting a module into notes and code

`split_source` reads a `.py` file with `tokenize` (to know what is a comment) and
`ast` (to know what is a docstring) and returns its rows: each row is some notes
(Markdown) beside the code they explain.

* the module docstring is the page intro; its front matter
  (`---\\ntitle: …\\nsummary: …\\n---`) feeds the title and description meta;
* a class/function docstring is the note beside its `def`/`class` line (decorators
  and a multi-line signature included); a comment block just above is merged in;
* a string literal right after an assignment (`x: int = 1`, `x = 1`) in a class
  or module body is that field's note, beside the assignment;
* a block of full-line `#` comments, at any indentation, is the note of the code
  that follows it, up to the next comment block or docstring; comments inside
  brackets, trailing comments and pragmas (`# noqa`, `# type:` …) stay code.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
import warnings
from dataclasses import dataclass, field

# Full-line comments that are instructions to tools, not notes: they stay code.
PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|pragma|pylint:|ruff:|isort:|mypy:)")
CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")
FRONT_MATTER = re.compile(r"\A---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.S)


@dataclass
class Section:
    """One row of a page: notes (Markdown) beside code starting at `lineno`."""

    doc: str
    code: str
    lineno: int  # 1-based line of the first code line; 0 when there is no code


@dataclass
class SplitModule:
    front: dict[str, str]
    sections: list[Section]


@dataclass
class _Open:
    docs: list[str] = field(default_factory=list)
    code: list[tuple[int, str]] = field(default_factory=list)

    def has_code(self) -> bool:
        return any(text.strip() for _, text in self.code)


def parse_front_matter(doc: str) -> tuple[dict[str, str], str]:
    """`---\\nkey: value\\n---` at the top of a docstring -> (dict, rest)."""
    match = FRONT_MATTER.match(doc)
    if not match:
        return {}, doc
    front: dict[str, str] = {}
    last = None
    for line in match.group(1).splitlines():
        if line[:1] in (" ", "\t") and last is not None:
            # an indented line continues the value above it (YAML's folding)
            front[last] = f"{front[last]} {line.strip()}".strip()
            continue
        key, sep, value = line.partition(":")
        if sep and key.strip():
            last = key.strip()
            front[last] = value.strip()
    for key, value in front.items():
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            front[key] = value[1:-1]
    return front, doc[match.end():]


def _string_expr(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _docstring_node(body: list[ast.stmt]) -> ast.Expr | None:
    if body and _string_expr(body[0]):
        return body[0]
    return None


def _docstring_text(source: str, node: ast.Expr) -> str:
    r"""
    The docstring as written in the file, not as Python evaluates it: without the
    `r` prefix, `\frac` in a docstring would evaluate to a form feed and `rac`;
    the page shows what the author typed.
    """
    literal = ast.get_source_segment(source, node.value) or ""
    match = re.match(r"^[rRuU]?(\"\"\"|'''|\"|')", literal)
    if not match or not literal.endswith(match.group(1)):
        # implicit concatenation: use the value
        return inspect.cleandoc(node.value.value)
    quote = match.group(1)
    return inspect.cleandoc(literal[match.end() : len(literal) - len(quote)])


def _alone_on_lines(node: ast.Expr, lines: list[str]) -> bool:
    """True when nothing but the string (and a comment) sits on its lines."""
    first = lines[node.lineno - 1]
    last = lines[node.end_lineno - 1]
    rest = last[node.end_col_offset:].strip()
    return first[: node.col_offset].strip() == "" and (not rest or rest[0] == "#")


def _comments(source: str) -> dict[int, str]:
    """
    Full-line comments outside brackets, by line; tokenize knows what is inside a
    string, so a `#` in a string or docstring is never a comment here.
    """
    comments: dict[int, str] = {}
    depth = 0
    readline = io.StringIO(source).readline
    for tok in tokenize.generate_tokens(readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.COMMENT:
            row, col = tok.start
            if depth or tok.line[:col].strip() or PRAGMA.match(tok.string):
                continue
            if row == 1 and tok.string.startswith("#!"):
                continue
            if row <= 2 and CODING.match(tok.line):
                continue
            text = tok.string[1:]
            comments[row] = text[1:] if text.startswith(" ") else text
    return comments


def _headers(source: str, tree: ast.Module, lines: list[str]):
    """
    Notes that sit beside a statement, keyed by the statement's first line:
    `(first line of the string, its last line, its text)`.

    Class/function docstrings annotate the `def`/`class` (decorators included);
    a field docstring, a string statement right after an assignment in a class or
    module body, annotates the assignment.
    """
    headers: dict[int, tuple[int, int, str]] = {}
    for owner in ast.walk(tree):
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node = _docstring_node(owner.body)
            if node is not None and node.lineno > owner.lineno:
                if _alone_on_lines(node, lines):
                    start = min([d.lineno for d in owner.decorator_list]
                                + [owner.lineno])
                    headers[start] = (node.lineno, node.end_lineno,
                                      _docstring_text(source, node))
        if not isinstance(owner, (ast.ClassDef, ast.Module)):
            continue
        body = owner.body
        for before, node in zip(body, body[1:]):
            if not isinstance(before, (ast.Assign, ast.AnnAssign)):
                continue
            if not _string_expr(node) or not _alone_on_lines(node, lines):
                continue
            if node.lineno <= before.end_lineno:
                continue
            headers[before.lineno] = (node.lineno, node.end_lineno,
                                      _docstring_text(source, node))
    return headers


def _module_parts(text: str) -> list[str]:
    """A module docstring cut before each `## ` heading outside code fences."""
    parts, current, fence = [], [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if not fence and line.startswith("## ") and any(x.strip() for x in current):
            parts.append("\n".join(current).strip("\n"))
            current = []
        current.append(line)
    parts.append("\n".join(current).strip("\n"))
    return [p for p in parts if p.strip()] or [text]


def split_source(source: str) -> SplitModule:
    """
    Split Python source into sections of (notes, code).

    Raises `SyntaxError` when the source does not parse.
    """
    with warnings.catch_warnings():
        # "invalid escape sequence" in a docstring is the module's business.
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
        tree = ast.parse(source)
    lines = source.splitlines()
    n_lines = len(lines)
    comments = _comments(source)

    front: dict[str, str] = {}
    module_doc = None
    node = _docstring_node(tree.body)
    if node is not None and _alone_on_lines(node, lines):
        front, text = parse_front_matter(_docstring_text(source, node))
        module_doc = (node.lineno, node.end_lineno, text.strip())
    headers = _headers(source, tree, lines)

    sections: list[Section] = []

    def flush(block: _Open) -> None:
        code = list(block.code)
        while code and not code[0][1].strip():
            code.pop(0)
        while code and not code[-1][1].strip():
            code.pop()
        doc = "\n\n".join(d for d in block.docs if d.strip()).strip("\n")
        if doc or code:
            text = "\n".join(t.rstrip() for _, t in code)
            sections.append(Section(doc, text, code[0][0] if code else 0))

    block = _Open()
    line = 1
    if module_doc is not None:
        first, last, text = module_doc
        # Shebang, encoding and licence lines above the docstring are shown as code.
        block.code = [(i, lines[i - 1]) for i in range(1, first)]
        # The opening, up to the docstring's first `## ` heading, is a row of
        # its own, and so is each `## ` part after it: each is set full width,
        # and a reader (and the limits of notes_beside_code) sees the opening
        # apart from the parts it introduces.
        parts = _module_parts(text)
        block.docs.append(parts[0])
        flush(block)
        for part in parts[1:]:
            sections.append(Section(part, "", 0))
        block = _Open()
        line = last + 1
    while line <= n_lines:
        if line in headers:
            doc_first, doc_last, text = headers[line]
            # A comment block right above a decorated def joins its docstring.
            if block.has_code():
                flush(block)
                block = _Open()
            block.code.extend((i, lines[i - 1]) for i in range(line, doc_first))
            block.docs.append(text)
            line = doc_last + 1
            continue
        if line in comments:
            if block.has_code():
                flush(block)
                block = _Open()
            group = []
            while line in comments:
                group.append(comments[line])
                line += 1
            block.docs.append("\n".join(group))
            continue
        block.code.append((line, lines[line - 1]))
        line += 1
    flush(block)
    return SplitModule(front, sections)
