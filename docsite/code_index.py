"""
---
title: An index of the code's names
summary: Every name the repository's Python defines or uses, read by ast, for the notes' checks.
---

# An index of the code's names

The checks of `docsite/code_refs.py` ask whether a name a note writes in
backticks exists. `CodeIndex(root)` answers from the code itself, read with
`ast` (nothing is imported but the libraries the code imports):

* **modules**: every `.py` file of `labml_zero/`, `bench/`, `tests/`,
  `docsite/` and `docs_src/` (and `build_docs.py`) by its dotted name, with its
  top-level names (functions, classes, assignments, imports) and constants;
* **classes**: their members (methods, class-body assignments and fields, every
  `self.x = …` in a method) and their bases, and **functions** with their
  parameters (what a call written in a note may pass);
* **names**: every identifier the code binds or reads (parameters, locals,
  attributes it reads, keywords it passes), and every identifier-like string
  constant outside `tests/` (`"bf16"`, `"nccl"`: values a note may quote; a
  test's strings are often wrong on purpose, so of those only upper-case names,
  the environment variables the tests read), and the words of the messages it
  prints (not of its docstrings: those are the notes being checked);
* **flags**: `FinetuneConfig`'s fields as `--seq-len` flags and every
  `"--x"` string of the code outside `tests/` (what it passes to
  `add_argument`);
* **libraries**: the modules the code imports that are not its own (`torch`,
  `torch.distributed` as `dist`), resolved by importing them on demand.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path

CODE_DIRS = ("labml_zero", "bench", "tests", "docsite", "docs_src")
CODE_FILES = ("build_docs.py",)
IDENT = re.compile(r"[A-Za-z_]\w*\Z")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\Z")
CONFIG_CLASS = ("labml_zero.finetune.config", "FinetuneConfig")


@dataclass
class Function:
    params: list[str]          # positional parameters, `self`/`cls` dropped
    required: int              # how many of them have no default
    keywords: set[str]         # every name a keyword may give
    star_args: bool = False
    star_kwargs: bool = False

    def accepts(self, positional: int, keywords: set[str]) -> bool:
        """Could a call with that many positional arguments and those keywords
        be this function's? Only keywords (`AdamFP16(free_grads=True)`) name an
        option and may leave out the required arguments."""
        if positional < 0:  # the call's arguments were not countable
            return True
        if positional > len(self.params) and not self.star_args:
            return False
        if not (self.star_kwargs or keywords <= self.keywords):
            return False
        given = set(self.params[:positional]) | keywords
        missing = [p for p in self.params[:self.required] if p not in given]
        return positional == 0 or not missing or self.star_args


@dataclass
class Class:
    module: str
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)
    methods: dict[str, Function] = field(default_factory=dict)


@dataclass
class Module:
    names: set[str] = field(default_factory=set)            # top-level names
    constants: dict[str, ast.expr] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> Function:
    a = node.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    n_defaults = len(a.defaults)
    if method and positional and positional[0] in ("self", "cls") and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod"
            for d in node.decorator_list):
        positional = positional[1:]
    return Function(positional, len(positional) - n_defaults,
                    set(positional) | {x.arg for x in a.kwonlyargs},
                    a.vararg is not None, a.kwarg is not None)


class CodeIndex:
    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, Module] = {}
        self.classes: dict[str, list[Class]] = {}
        self.functions: dict[str, list[Function]] = {}
        self.names: set[str] = (set(dir(builtins)) | set(dir(object))
                                | set(keyword.kwlist))
        self.variables: set[str] = set()   # parameters, locals, self.x: values
        self.strings: set[str] = set()
        self.words: set[str] = set()       # words of the messages the code prints
        self.flags: set[str] = set()
        self.aliases: dict[str, str] = {}   # local name -> a library's dotted name
        self.libraries: set[str] = set()    # top-level library modules imported
        self.paths: set[str] = set()        # every file of the repository, relative
        self._imported: dict[str, object] = {}
        files = [p for d in CODE_DIRS if (root / d).is_dir()
                 for p in sorted((root / d).rglob("*.py"))]
        files += [root / f for f in CODE_FILES if (root / f).is_file()]
        own = {p.relative_to(root).parts[0].removesuffix(".py") for p in files}
        self.own_tops = own
        for path in files:
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root).with_suffix("").as_posix()
            dotted = rel.removesuffix("/__init__").replace("/", ".")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError:
                continue
            self._read(dotted, tree)
        self._read_flags()
        self.flags.add("--help")  # argparse's own
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if rel.parts and rel.parts[0] in (".git", "site", ".venv"):
                continue
            if "__pycache__" not in rel.parts:
                self.paths.add(rel.as_posix())

    # -- reading -----------------------------------------------------------------

    def _read(self, dotted: str, tree: ast.Module) -> None:
        module = self.modules.setdefault(dotted, Module())
        self.names.update(dotted.split("."))
        for node in tree.body:
            for target in _bound(node):
                module.names.add(target)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value:
                for target in _bound(node):
                    module.constants[target] = node.value
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                module.functions[node.name] = _function(node, method=False)
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self._read_class(dotted, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names.add(node.name)
                self.functions.setdefault(node.name, []).append(
                    _function(node, method=True))
                a = node.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                    if arg is not None:
                        self.names.add(arg.arg)
                        self.variables.add(arg.arg)
            elif isinstance(node, ast.Name):
                self.names.add(node.id)
                if isinstance(node.ctx, ast.Store):
                    self.variables.add(node.id)
            elif isinstance(node, ast.Attribute):
                self.names.add(node.attr)
                if isinstance(node.ctx, ast.Store):
                    self.variables.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                self.names.add(node.arg)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and (not dotted.startswith("tests")
                       or re.fullmatch(r"[A-Z][A-Z0-9_]+", node.value))):
                # a test's strings are inputs, often wrong on purpose: only its
                # environment variables' names (`LABML_ZERO_TEST_DEVICE`) count
                value = node.value
                if DOTTED.match(value) or re.fullmatch(r"[\w.-]+", value):
                    self.strings.add(value)
                if id(node) not in docstrings:  # a message, not a note
                    self.words.update(re.findall(r"[A-Za-z_][\w-]*", value))
                if value.startswith("--") and re.fullmatch(r"--[\w-]+", value):
                    self.flags.add(value)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self._read_import(dotted, node)

    def _read_class(self, dotted: str, node: ast.ClassDef) -> None:
        cls = Class(dotted, bases=[ast.unparse(b) for b in node.bases])
        self.names.add(node.name)
        for item in node.body:
            cls.members.update(_bound(item))
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cls.methods[item.name] = _function(item, method=True)
        for item in ast.walk(node):
            if (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                    and isinstance(item.value, ast.Name) and item.value.id == "self"):
                cls.members.add(item.attr)
        self.classes.setdefault(node.name, []).append(cls)

    def _read_import(self, dotted: str, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                self.names.update(alias.name.split("."))
                if top not in self.own_tops:
                    self.libraries.add(top)
                    self.aliases[alias.asname or top] = alias.asname and alias.name or top
                if alias.asname:
                    self.names.add(alias.asname)
            return
        base = node.module or ""
        if node.level:  # relative: inside our own package
            base = ".".join(dotted.split(".")[:-node.level] + ([base] if base else []))
        for alias in node.names:
            local = alias.asname or alias.name
            self.names.update({alias.name, local})
            top = base.split(".")[0]
            if top and top not in self.own_tops:
                self.libraries.add(top)
                self.aliases[local] = f"{base}.{alias.name}"

    def _read_flags(self) -> None:
        module, name = CONFIG_CLASS
        for cls in self.classes.get(name, []):
            if cls.module == module:
                self.flags.update("--" + m.replace("_", "-") for m in cls.members
                                  if not m.startswith("_"))

    # -- questions the checks ask ----------------------------------------------

    def library(self, dotted: str):
        """A library object by dotted name (`torch.cuda.synchronize`), or None."""
        parts = dotted.split(".")
        if parts[0] in self.aliases:
            parts = self.aliases[parts[0]].split(".") + parts[1:]
        if parts[0] not in self.libraries and parts[0] not in ("builtins",):
            return None
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            try:
                if name not in self._imported:
                    self._imported[name] = importlib.import_module(name)
                obj = self._imported[name]
            except Exception:  # noqa: BLE001 -- not a module: try a shorter one
                continue
            for attr in parts[n:]:
                try:
                    obj = getattr(obj, attr)
                except Exception:  # noqa: BLE001 -- a missing attribute
                    return None
            return obj
        return None

    def module_for(self, parts: list[str]) -> tuple[str, int] | None:
        """The longest prefix of `parts` that names one of our modules (by its
        full dotted name or a tail of it, `zero3.chunk`), and its length."""
        for n in range(len(parts), 0, -1):
            tail = ".".join(parts[:n])
            hits = [m for m in self.modules if m == tail or m.endswith("." + tail)]
            if hits:
                return sorted(hits, key=len)[0], n
        return None

    def class_members(self, name: str, seen: frozenset = frozenset()) -> set[str] | None:
        """Members of our class `name` with its bases'; None when a base is a
        library's class (whose members are not read)."""
        out: set[str] = set()
        for cls in self.classes.get(name, []):
            out |= cls.members
            for base in cls.bases:
                short = base.split(".")[-1].split("[")[0]
                if short in ("object", "Generic", "Protocol", "NamedTuple",
                             "Exception", "ValueError", "RuntimeError", "TypeError"):
                    continue
                if short in self.classes and short not in seen:
                    more = self.class_members(short, seen | {name})
                    if more is None:
                        return None
                    out |= more
                elif short == "Enum" or short.endswith("Enum"):
                    out |= {"name", "value"}
                else:
                    return None
        return out


def _bound(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    out = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                out.append(n.id)
    return out
