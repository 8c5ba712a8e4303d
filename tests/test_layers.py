"""The package's folders are its layers: every import runs downward, none in a circle.

`import_graph` reads every module of `labml_zero/` with `ast` (no import runs) and
records each first-party import, those inside functions included: a function-local
import hides a circle from Python's loader, not from a reader. `LAYERS` is the
order, lowest first; a module may import its own folder and the layers below it.
`python tests/test_layers.py [ROOT]` prints the findings for a checkout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "labml_zero"

# Lowest first. The tools at the bottom (atomic files, processes, the app) import
# nothing of the others; the engine, its optimizer, the policy (the memory
# model, the chunk-size search, placement, the memory budget and the search
# for a setting: the planner's folder, given a model's family as an object),
# the one assembly path, the family type, the layers and Hugging Face files
# every family shares, the models, the registry of families and the fine-tune
# job each import only what is listed before them.
LAYERS = (
    ("labml_zero", "labml_zero.files", "labml_zero.launch", "labml_zero.app"),
    ("labml_zero.zero3",),
    ("labml_zero.optimizers",),
    ("labml_zero.planner",),
    ("labml_zero.assembly",),
    ("labml_zero.family",),
    ("labml_zero.layers",),
    ("labml_zero.hf",),
    ("labml_zero.neox",),
    ("labml_zero.llama",),
    ("labml_zero.families",),
    ("labml_zero.finetune",),
    ("labml_zero.finetune_neox", "labml_zero.export"),
)


class Import(NamedTuple):
    source: str
    target: str
    line: int
    local: bool
    """Inside a function (or any block below the module's top level)."""


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's `__init__`)."""
    found = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(root: Path = REPO) -> list[Import]:
    """Every first-party import of every module, resolved to the module it loads:
    `from a.b import c` is `a.b.c` when that is a module, else `a.b`."""
    known = modules(root)
    found = []
    for name, (path, is_package) in sorted(known.items()):
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1]
                                    + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known
                           else base for a in node.names]
            else:
                continue
            local = node.col_offset > 0
            for target in set(targets):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append(Import(name, target, node.lineno, local))
    return found


def layer(module: str) -> tuple[int, str] | None:
    """The layer's index and the folder (group) a module belongs to; `None` for
    a module no group names (the package's own page only as itself)."""
    best = None
    for index, groups in enumerate(LAYERS):
        for group in groups:
            inside = group != PACKAGE and module.startswith(group + ".")
            if (module == group or inside) and (best is None
                                                or len(group) > len(best[1])):
                best = (index, group)
    return best


def upward(graph: list[Import]) -> list[str]:
    """Imports of a folder that is not below the importer's (the same folder is
    fine: its circles are `cycles`' to find)."""
    bad = []
    for imp in graph:
        if layer(imp.source) is None or layer(imp.target) is None:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target}: not both "
                       f"in a layer")
            continue
        (src_layer, src_group), (dst_layer, dst_group) = (layer(imp.source),
                                                          layer(imp.target))
        if src_group != dst_group and dst_layer >= src_layer:
            bad.append(f"{imp.source}:{imp.line} imports {imp.target}"
                       f"{' (function-local)' if imp.local else ''}: layer "
                       f"{dst_group} is not below {src_group}")
    return bad


def cycles(graph: list[Import]) -> list[str]:
    """Every circle of the module graph, as `a -> b -> a` (Tarjan's strongly
    connected components; one line per component of more than one module)."""
    edges: dict[str, set[str]] = {}
    for imp in graph:
        edges.setdefault(imp.source, set()).add(imp.target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def hidden(graph: list[Import]) -> list[str]:
    """First-party imports inside functions: each hides an order the page does not
    show (the only function-local imports left are of optional or heavy
    third-party packages)."""
    return [f"{imp.source}:{imp.line} imports {imp.target} inside a function"
            for imp in graph if imp.local]


def findings(root: Path = REPO) -> dict[str, list[str]]:
    graph = import_graph(root)
    return {"upward": upward(graph), "cycles": cycles(graph),
            "function-local": hidden(graph)}


def test_no_import_runs_up_and_none_in_a_circle():
    found = findings()
    assert found == {"upward": [], "cycles": [], "function-local": []}, found


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    # the check itself: a planted circle (hidden in a function) and an import
    # from the engine up into the model are both reported
    pkg = tmp_path / PACKAGE
    (pkg / "zero3").mkdir(parents=True)
    (pkg / "neox").mkdir()
    for init in (pkg, pkg / "zero3", pkg / "neox"):
        (init / "__init__.py").write_text("")
    (pkg / "zero3" / "a.py").write_text("from labml_zero.neox.m import x\n")
    (pkg / "neox" / "m.py").write_text("from . import n\n")
    (pkg / "neox" / "n.py").write_text("def f():\n    from .m import x\n")
    found = findings(tmp_path)
    assert found["upward"] == [
        "labml_zero.zero3.a:1 imports labml_zero.neox.m: layer labml_zero.neox "
        "is not below labml_zero.zero3"]
    assert found["cycles"] == ["labml_zero.neox.m <-> labml_zero.neox.n"]
    assert found["function-local"] == [
        "labml_zero.neox.n:2 imports labml_zero.neox.m inside a function"]


# The job asks the family (labml_zero/family.py) for everything model-specific:
# no module of it imports a model package, and a new family is one package plus
# one line of the registry.
MODEL_PACKAGES = ("labml_zero.neox", "labml_zero.llama")


# The planner is given the family as an object (`BudgetInputs.family`,
# `Job.family`): it sizes every family's model and imports none.
FAMILY_BLIND = ("labml_zero.finetune", "labml_zero.planner")


def model_imports(graph) -> dict[str, set[str]]:
    """`{job or planner module: the model modules it imports}`."""
    found: dict[str, set[str]] = {}
    for imp in graph:
        if imp.source.startswith(tuple(f"{p}." for p in FAMILY_BLIND)) \
                and imp.target.startswith(MODEL_PACKAGES):
            found.setdefault(imp.source, set()).add(
                imp.target.removeprefix("labml_zero."))
    return found


def test_the_job_and_the_planner_import_no_model_package():
    assert model_imports(import_graph()) == {}


def test_the_rule_sees_a_job_that_imports_a_model(tmp_path):
    pkg = tmp_path / "labml_zero"
    for sub in ("finetune", "neox", "llama"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "llama" / "model.py").write_text("x = 1\n")
    (pkg / "finetune" / "job.py").write_text(
        "from labml_zero.llama.model import x\n")
    (pkg / "planner").mkdir()
    (pkg / "planner" / "__init__.py").write_text("")
    (pkg / "planner" / "setting.py").write_text(
        "from labml_zero.neox import model\n")
    (pkg / "neox" / "model.py").write_text("x = 1\n")
    assert model_imports(import_graph(tmp_path)) == {
        "labml_zero.finetune.job": {"llama.model"},
        "labml_zero.planner.setting": {"neox.model"}}


# The mechanism (`zero3/`: what a step runs) takes its sizes and placements as
# arguments; the policy that chooses them (`planner/`) imports the mechanism,
# never the other way.
MECHANISM, POLICY = "labml_zero.zero3", "labml_zero.planner"


def policy_imports(graph) -> list[str]:
    """Every import of the policy by the mechanism, as `source:line -> target`."""
    return [f"{imp.source}:{imp.line} -> {imp.target}" for imp in graph
            if (imp.source == MECHANISM or imp.source.startswith(MECHANISM + "."))
            and (imp.target == POLICY or imp.target.startswith(POLICY + "."))]


def test_the_mechanism_imports_nothing_from_the_policy():
    assert policy_imports(import_graph()) == []


def test_the_rule_sees_the_mechanism_import_the_policy(tmp_path):
    pkg = tmp_path / "labml_zero"
    for sub in ("zero3", "planner"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "planner" / "memory_model.py").write_text("x = 1\n")
    (pkg / "zero3" / "hybrid.py").write_text(
        "\n\ndef f():\n    from labml_zero.planner.memory_model import x\n")
    assert policy_imports(import_graph(tmp_path)) == [
        "labml_zero.zero3.hybrid:4 -> labml_zero.planner.memory_model"]


def test_every_module_is_in_a_layer():
    assert [name for name in modules(REPO) if layer(name) is None] == []


def run_help(module: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_public_commands_still_start():
    # the entry points keep their old names after the move into packages
    finetune = run_help("labml_zero.finetune_neox")
    assert finetune.returncode == 0, finetune.stderr
    assert "usage: python -m labml_zero.finetune_neox" in finetune.stdout
    app = run_help("labml_zero.app")
    assert app.returncode == 0, app.stderr
    assert "usage: python -m labml_zero.app" in app.stdout


def test_the_public_names_still_import():
    # labml-nn's names and the engine's package, where they always were
    from labml_zero.optimizers.adam_fp16 import AdamFP16
    from labml_zero.zero3 import Zero3Layer, Zero3Sequential

    assert callable(Zero3Layer) and callable(AdamFP16)
    assert hasattr(Zero3Sequential, "get_trainable_chunk")


if __name__ == "__main__":
    for check, lines in findings(Path(sys.argv[1]) if len(sys.argv) > 1
                                 else REPO).items():
        print(f"{check}: {len(lines)}")
        for line in lines:
            print(f"  {line}")
