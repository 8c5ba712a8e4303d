"""
---
title: Names and constants the notes quote
summary: Every backticked name, flag and file of a note exists; every quoted constant is the code's.
---

# Names and constants the notes quote

A note that names `LocalShard.add_grad` when the code has no such method, or
says `BACKWARD_EXTRA_UNITS = 1` when the code says 0, teaches something false.
Two checks of `docsite/lint.py` read every code span of every note (the
glossary's meanings too) against `CodeIndex` (`docsite/code_index.py`):

* **names**: a span that looks like a Python name or a dotted path, with or
  without a call (`chunk.gather(async_op=True)`, `ChunkState.GATHERED`,
  `torch.cuda.synchronize()`), must resolve:
  * through one of our modules (`memory_model.bytes_per_param`: the module's
    top-level name), one of our classes (`Chunk.gather`: a member, its bases'
    included), or a library the code imports (`dist.all_gather_into_tensor`,
    by importing it);
  * else each part must be a name the code binds or reads somewhere (a
    parameter, a local, an attribute, a keyword, an identifier-like string),
    and a single word may be one of the code's messages (`interrupted`);
  * a call with arguments must fit the signature of some function of that
    name (`add_grad(reduced)` fits none of the code's `add_grad`s);
  * a flag (`--seq-len 128`) must be a `FinetuneConfig` field or an
    `add_argument` flag, a file (`docs_src/glossary.txt`, `chunk.py`) must
    exist (from the repository's root, the page's folder or the package's), or
    be a file name the code uses in a string (`tokenizer.json`);
* **constants**: a span `NAME = value` with an upper-case `NAME` restates a
  constant of the code, which drifts when the code changes: it is a finding,
  whose text says whether it still matches. Write `{{const: NAME}}` instead:
  the builder shows `NAME = value` with the value read from the code
  (`module.NAME` when two modules define the name).

What is not read: spans with spaces or operators (`x + 1`, `# see Note: …`),
shell commands, and anything in fenced code blocks.
"""

from __future__ import annotations

import ast
import fnmatch
import html
import re
from pathlib import Path

from .code_index import DOTTED, IDENT, CodeIndex
from .paths import BuildError

SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CALL = re.compile(r"(?P<name>[A-Za-z_][\w.]*)(?P<call>\((?P<args>.*)\))?"
                  r"(?P<sub>\[[^\]]*\])?\Z", re.S)
ASSIGN = re.compile(r"(?P<name>[A-Za-z_][\w.]*)\s*(?::\s*[\w\[\]., |]+)?\s*=\s*"
                    r"(?P<value>[^=].*)\Z", re.S)
FLAG = re.compile(r"(--[A-Za-z][\w-]*)(?:[ =]\S.*)?\Z", re.S)
FILE_EXT = (r"py|txt|md|json|jsonl|toml|sh|svg|html|css|js|cfg|ini|yaml|yml|gz|"
            r"otf|png|safetensors|bin|pt|csv")
FILE = re.compile(rf"(?P<path>[\w.~*/-]*[\w*](?:\.(?:{FILE_EXT}))|[\w.-]+/[\w./*-]*)"
                  r"(?::\d+|::\w+)?\Z")
CONST = re.compile(r"\{\{const:\s*([\w.]+)\s*\}\}")
UPPER = re.compile(r"[A-Z][A-Z0-9_]*\Z")
# "`OPTIMIZER_BYTES` = 12", "`X` is 0", "`X` (= 2)": a constant restated in prose
PROSE_CONST = re.compile(r"`([A-Z][A-Z0-9_]*)`\s*(?:=|is|equals|\(=?)\s*\$?(-?\d[\d.]*)")


def code_spans(markdown: str) -> list[str]:
    """The inline code spans of a note (fenced blocks are examples, not names)."""
    return [" ".join(m.group(2).split()) for m in SPAN.finditer(FENCE.sub(" ", markdown))]


def constant_value(index: CodeIndex, name: str, where: str):
    """`NAME` or `module.NAME` -> (dotted module, value) from the code."""
    *mod_parts, const = name.split(".")
    hits = []
    for dotted, module in index.modules.items():
        if const in module.constants and (
                not mod_parts or dotted == ".".join(mod_parts)
                or dotted.endswith("." + ".".join(mod_parts))):
            hits.append(dotted)
    hits = [h for h in hits if not h.startswith(("tests", "docsite"))] or hits
    if not hits:
        raise BuildError(f"{where}: {{{{const: {name}}}}}: no module assigns {const}")
    if len(hits) > 1:
        raise BuildError(f"{where}: {{{{const: {name}}}}}: {const} is assigned in "
                         f"{', '.join(sorted(hits))}; write module.{const}")
    expr = index.modules[hits[0]].constants[const]
    try:
        return hits[0], ast.literal_eval(expr)
    except ValueError:
        import importlib

        return hits[0], getattr(importlib.import_module(hits[0]), const)


def expand_constants(text: str, page: str, index: CodeIndex) -> str:
    """`{{const: NAME}}` -> `<code>NAME = value</code>`, the value from the code."""
    def one(match: re.Match) -> str:
        name = match.group(1)
        _, value = constant_value(index, name, page)
        return f"<code>{html.escape(name.split('.')[-1])} = {html.escape(repr(value))}</code>"

    return CONST.sub(one, text)


class Checker:
    def __init__(self, root: Path):
        self.root = root
        self.index = CodeIndex(root)
        self._library_names: set[str] | None = None

    # -- names -------------------------------------------------------------------

    def name_problem(self, span: str, page: str) -> str | None:
        """Why a span that looks like a name, flag or file does not resolve."""
        if FLAG.match(span):
            flag = FLAG.match(span).group(1)
            return None if flag in self.index.flags else "no such flag"
        m = ASSIGN.match(span)
        if m and DOTTED.match(m.group("name")):
            span = m.group("name")
        file = FILE.match(span)
        if file and ("/" in span or re.search(rf"\.(?:{FILE_EXT})(?:::\w+)?\Z", span)):
            return self.file_problem(file.group("path"), page)
        m = CALL.match(span)
        if not m or not DOTTED.match(m.group("name")):
            return None  # not a name: an expression, a command, prose
        name, args = m.group("name"), m.group("args")
        problem = self.dotted_problem(name)
        if problem or args is None:
            return problem
        return self.call_problem(name.split(".")[-1], args)

    def dotted_problem(self, name: str) -> str | None:
        idx = self.index
        parts = name.split(".")
        if any(name in s for s in idx.strings):
            return None  # the code names it in a string (a checkpoint key, a value)
        if len(parts) == 1:
            if (name in idx.names or name in idx.classes or name in idx.words
                    or self._in_library(name)
                    or name.endswith("_") and any(n.startswith(name) for n in idx.names)
                    or any(p.rsplit("/", 1)[-1] == name for p in idx.paths)):
                return None
            return "not a name in the code"
        found = idx.module_for(parts)
        problem = None
        if found:
            module, n = found
            rest = parts[n:]
            if not rest:
                return None
            if rest[0] in idx.modules[module].names or f"{module}.{rest[0]}" in idx.modules:
                parts = rest
            else:
                problem = f"{module} has no {rest[0]}"
        if parts[0] in idx.classes and len(parts) > 1 and not problem:
            members = idx.class_members(parts[0])
            if members is not None and parts[1] not in members:
                return f"class {parts[0]} has no {parts[1]}"
            return self._lax(parts[2:])
        if parts[0] in idx.aliases or parts[0] in idx.libraries:
            if idx.library(".".join(parts)) is not None:
                return None
            problem = problem or f"{name} is not in the library"
        # a variable's attributes: `model.chunks`, `chunk.local`
        lax = self._lax(parts)
        return problem if lax and problem else lax

    def _in_library(self, name: str) -> bool:
        """Is `name` a top-level name of a library module the code imports, or
        a member of a library class that one of our classes extends?"""
        if self._library_names is None:
            idx, found = self.index, set()
            objects = [idx.library(v) for v in sorted(set(idx.aliases.values())
                                                      | idx.libraries)]
            objects += [idx.library(b) for classes in idx.classes.values()
                        for c in classes for b in c.bases]
            for obj in objects:
                if obj is not None:
                    found.update(dir(obj))
            self._library_names = found
        return name in self._library_names

    def _lax(self, parts: list[str]) -> str | None:
        unknown = [p for p in parts if p not in self.index.names
                   and p not in self.index.strings]
        return f"{unknown[0]} is not a name in the code" if unknown else None

    def call_problem(self, name: str, args: str) -> str | None:
        idx = self.index
        short = name.split(".")[-1]
        positional, keywords = _arguments(args)
        target = idx.library(name)
        if target is not None and callable(target):
            import inspect

            try:
                sig = inspect.signature(target)
            except (TypeError, ValueError):
                return None
            try:
                sig.bind_partial(*range(max(positional, 0)),
                                 **{k: None for k in keywords})
                return None
            except TypeError as exc:
                return f"{name}({args}): {exc}"
        if short in idx.variables:
            return None  # also a parameter or a local holding a callable
        candidates = idx.functions.get(short, []) + [
            c.methods["__init__"] for c in idx.classes.get(short, [])
            if "__init__" in c.methods]
        if not candidates or any(f.accepts(positional, keywords) for f in candidates):
            return None
        return f"no {short} takes ({args})"

    def file_problem(self, path: str, page: str) -> str | None:
        idx = self.index
        if path.startswith(("/", "~", "$")) or "://" in path:
            return None
        path = path.rstrip("/")
        bases = ["", str(Path(page).parent), "labml_zero"]
        for base in bases:
            full = f"{base}/{path}".lstrip("/") if base not in ("", ".") else path
            if "*" in path:
                if list(self.root.glob(full)):
                    return None
            elif full in idx.paths:
                return None
        if any(p.endswith("/" + path) for p in idx.paths):
            return None  # a path inside a folder the page speaks of
        name = path.rsplit("/", 1)[-1]
        if "/" not in path and any(p.rsplit("/", 1)[-1] == name for p in idx.paths):
            return None
        # a file name the code uses: `tokenizer.json`, `EleutherAI/pythia-*`
        if any(fnmatch.fnmatchcase(s, f"*{path}*") for s in idx.strings):
            return None
        return "no such file"

    # -- constants -----------------------------------------------------------

    def constant_problem(self, span: str, page: str) -> str | None:
        m = ASSIGN.match(span)
        if not m or not UPPER.match(m.group("name").split(".")[-1]):
            return None
        name = m.group("name")
        try:
            _, value = constant_value(self.index, name, page)
        except BuildError:
            return None  # not a constant of the code (an environment variable)
        try:
            stated = ast.literal_eval(m.group("value").strip())
        except (ValueError, SyntaxError):
            return "restated; write {{const: " + name + "}}"
        same = "matches" if stated == value else f"the code says {value!r}"
        return f"restated ({same}); write {{{{const: {name}}}}}"

    def check(self, notes: dict[str, str]) -> dict[str, set[str]]:
        """page -> Markdown of its notes  ->  {"names": …, "constants": …}."""
        out = {"names": set(), "constants": set()}
        for page, markdown in notes.items():
            for m in PROSE_CONST.finditer(FENCE.sub(" ", markdown)):
                problem = self.constant_problem(f"{m.group(1)} = {m.group(2)}", page)
                if problem:
                    out["constants"].add(f"{page} | `{m.group(1)}` {m.group(2)} {problem}")
            for span in code_spans(markdown):
                problem = self.constant_problem(span, page)
                if problem:
                    out["constants"].add(f"{page} | `{span}` {problem}")
                    continue
                problem = self.name_problem(span, page)
                if problem:
                    out["names"].add(f"{page} | `{span}` {problem}")
        return out


def _arguments(args: str) -> tuple[int, set[str]]:
    """(positional count, keyword names) of a call's text, or (-1, …) when it
    is a placeholder (`...`, `…`) or does not parse."""
    text = args.strip()
    if not text or "..." in text or "…" in text:
        return -1, set()
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError:
        return -1, set()
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords):
        return -1, set()
    return len(call.args), {k.arg for k in call.keywords}


__all__ = ["Checker", "code_spans", "constant_value", "expand_constants", "IDENT"]
