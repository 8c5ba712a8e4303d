"""The builder's pieces: field docstrings, math, the reading order, the Results
page and the directives, on small inputs and on the repository's own site."""

from __future__ import annotations

import json
import posixpath
import re
import shutil
from pathlib import Path

import pytest

import build_docs
from docsite import order, results
from docsite.directives import Directives, evaluate
from docsite.markdown import visible_text
from docsite.mathml import spelled_commands, to_mathml
from docsite.paths import BuildError

REPO = Path(__file__).resolve().parents[2]


def test_field_docstrings_are_notes_beside_their_field():
    src = ('class C:\n    """The class."""\n\n    x: int = 1\n'
           '    """Bytes per element, $b$."""\n    y = 2\n    """Why $y$."""\n'
           '    z = 3\n\n\nN = 4\n"""A module constant."""\n')
    rows = [(s.doc, s.code) for s in build_docs.split_source(src).sections]
    assert rows == [
        ("The class.", "class C:"),
        ("Bytes per element, $b$.", "    x: int = 1"),
        ("Why $y$.", "    y = 2\n    z = 3"),
        ("A module constant.", "N = 4"),
    ]


def test_aligned_rows_render_and_bad_tex_stops_the_build():
    out = to_mathml(r"\begin{aligned} a &= b \\ c &= d \end{aligned}",
                    display=True, where="p.html")
    assert out.count("<mtr>") == 2 and "&amp;" not in out and "<mi>&" not in out
    assert "operatorname" not in to_mathml(r"\arg\max_v x", display=False, where="p")
    with pytest.raises(BuildError, match=r"p\.html: numbered environment"):
        to_mathml(r"\begin{align} a &= b \end{align}", display=True, where="p.html")
    with pytest.raises(BuildError, match=r"p\.html: unsupported TeX '\\foo'"):
        to_mathml(r"\foo x", display=False, where="p.html")
    with pytest.raises(BuildError, match="'&' outside aligned"):
        to_mathml(r"a &= b", display=False, where="p.html")
    assert spelled_commands(r"2 \\times 8") == [r"\\times"]
    assert spelled_commands(r"2 times 8, \text{times}") == ["times"]
    assert spelled_commands(r"2 \times 8 \\ x") == []


def _order_tree(tmp: Path, lines: str) -> list[str]:
    (tmp / "docs_src").mkdir()
    (tmp / "docs_src" / "reading_order.txt").write_text(lines)
    return ["labml_zero/__init__.py", "labml_zero/a.py", "labml_zero/b/__init__.py",
            "labml_zero/b/c.py"]


def test_reading_order_refuses_missing_twice_and_gone(tmp_path):
    mods = _order_tree(tmp_path, "labml_zero/__init__.py\nlabml_zero/a.py\n")
    with pytest.raises(BuildError, match=r"labml_zero/b/__init__.py has no place.*"
                                         r"add it as one line.*\(1 more missing\)"):
        order.load_order(tmp_path, mods)
    (tmp_path / order.ORDER_FILE).write_text("labml_zero/a.py\nlabml_zero/a.py\n")
    with pytest.raises(BuildError, match="listed twice"):
        order.load_order(tmp_path, mods)
    (tmp_path / order.ORDER_FILE).write_text("labml_zero/gone.py\n")
    with pytest.raises(BuildError, match="gone.py does not exist"):
        order.load_order(tmp_path, mods)
    (tmp_path / order.ORDER_FILE).write_text(
        "## One\nlabml_zero/__init__.py\nlabml_zero/b/__init__.py\n## Two\n"
        "labml_zero/b/c.py\nlabml_zero/a.py\n@results\n")
    parts = order.load_order(tmp_path, mods)
    assert [p.title for p in parts] == ["One", "Two"]
    titles = {e: (e, "") for e in order.flat(parts)}
    assert order.folder_list(parts, "labml_zero/__init__.py", titles) == (
        "1. [labml_zero/b/__init__.py](b/index.html)\n"
        "1. [labml_zero/a.py](a.html)\n")
    titles["labml_zero/a.py"] = ("A", 'What "a" does, `a()` and $N_d$.')
    assert order.folder_list(parts, "labml_zero/__init__.py", titles).endswith(
        "1. [A](a.html \"What 'a' does, a() and N_d.\")\n")


def _chain(files: dict[str, bytes]) -> list[str]:
    page, seen = "index.html", []
    while page and page not in seen:
        seen.append(page)
        html = files[page].decode()
        nxt = re.search(r'class="next" href="([^"]+)"', html)
        if not nxt:
            break
        page = order.posixpath.normpath(
            order.posixpath.join(order.posixpath.dirname(page), nxt.group(1)))
    return seen


def test_one_reading_order_for_the_chain_the_home_page_and_the_folders(site_files):
    parts = order.load_order(REPO, build_docs.discover_modules(REPO))
    expected = ["index.html"] + [order.page_of(e) for e in order.flat(parts)]
    assert _chain(site_files) == expected  # every page once, in the file's order
    home = site_files["index.html"].decode()
    listed = re.findall(r'<li><a href="([^"]+)"', home.split('id="reading-order"')[1])
    assert listed == expected[1:]
    for entry in order.flat(parts):
        # the package's own page, the core path's overview, has no folder list
        if not entry.endswith("__init__.py") or entry == "labml_zero/__init__.py":
            continue
        page = order.page_of(entry)
        html = site_files[page].decode()
        section = html.split('id="pages-in-this-folder"', 1)
        links = re.findall(r'<li><a href="([^"]+)"', section[1].split("</ol>")[0])
        folder = order.posixpath.dirname(page)
        pages = [order.posixpath.normpath(order.posixpath.join(folder, h))
                 for h in links]
        assert pages == [p for p in expected if p != page and (
            order.posixpath.dirname(p) == folder or (
                p.endswith("/index.html") and order.posixpath.dirname(
                    order.posixpath.dirname(p)) == folder))
            and p not in ("results.html", "glossary.html")], page
    # Key chapters come in the order a learner needs them.
    pos = {e: i for i, e in enumerate(order.flat(parts))}
    chain = ["__init__", "planner/memory_model", "zero3/hooks", "optimizers/adam_fp16",
             "zero3/sharded_model", "planner/chunk_search", "zero3/chunk_layout",
             "zero3/chunk", "zero3/communication", "planner/placement",
             "zero3/peer_memory", "zero3/compiled", "zero3/checkpoint/__init__",
             "neox/model", "finetune/job", "launch/spawn", "app/server"]
    idx = [pos[f"labml_zero/{c}.py"] for c in chain]
    assert idx == sorted(idx)


def test_results_keep_the_latest_line_of_each_configuration(tmp_path):
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    line = {"engine": "labml_zero", "workload": "W2", "world_size": 2,
            "status": "ok", "tokens_per_s": 100.0, "mfu": 0.5, "peak_mem_gib": 1.0,
            "step_time_mean_s": 1.0, "step_time_std_s": 0.1, "loss": 2.0,
            "torch": "2.11", "device": "GPU", "steps": 10, "warmup": 3,
            "batch_per_gpu": 2, "seq": 2048}
    (folder / "2026-01-02-run2-x.jsonl").write_text(
        json.dumps({**line, "tokens_per_s": 300.0}) + "\n")
    (folder / "2026-01-02-run10-x.jsonl").write_text(
        json.dumps(line) + "\n" + json.dumps({**line, "tokens_per_s": 200.0}) + "\n"
        + json.dumps({"engine": "labml_zero", "workload": "W2"}) + "\n")
    found = results.load_results(tmp_path)
    assert [m.line["tokens_per_s"] for m in found.values()] == [200.0]
    assert results.lookup(found, "W2 labml_zero tokens_per_s")[0] == "200 tokens/s"
    with pytest.raises(BuildError, match="no successful measurement"):
        results.lookup(found, "W2 labml_zero compiled tokens_per_s")
    with pytest.raises(BuildError, match="field 'speed'"):
        results.lookup(found, "W2 labml_zero speed")
    page = results.results_markdown(found)
    assert "| 2 | 2026-01-02 | 2.11 | `2026-01-02-run10-x.jsonl` |" in page
    assert "`python -m bench.run --workloads W2 --engines labml_zero" in page
    assert "--batch 2`" in page

    # one configuration at two batch sizes: a note must say which
    (folder / "2026-01-03-run1-x.jsonl").write_text(
        json.dumps({**line, "batch_per_gpu": 4, "tokens_per_s": 400.0}) + "\n"
        + json.dumps({**line, "batch_per_gpu": 8, "status": "oom",
                      "where": "host"}) + "\n")
    found = results.load_results(tmp_path)
    with pytest.raises(BuildError, match=r"batch sizes \[2, 4, 8\]; add batch=B"):
        results.lookup(found, "W2 labml_zero tokens_per_s")
    assert results.lookup(found, "W2 labml_zero batch=4 tokens_per_s")[0] == (
        "400 tokens/s")
    assert "| 8 × 2048 | oom (host) |" in results.results_markdown(found)


def test_results_keep_fp8_lines_and_other_depths_apart(tmp_path):
    """A labml_zero line with fp8 products, or of a model at another depth
    (`bench.run --layers`), is a configuration of its own: neither replaces
    the bf16 full-depth line, nor is an fp8 line labml_zero's best against
    peers that multiply in bf16; a shallower line's MFU has its own FLOPs."""
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    line = {"engine": "labml_zero", "workload": "W1", "world_size": 1,
            "status": "ok", "tokens_per_s": 100.0, "peak_mem_gib": 1.0,
            "step_time_mean_s": 1.0, "step_time_std_s": 0.1, "loss": 2.0,
            "device": "NVIDIA H100 80GB HBM3", "batch_per_gpu": 8, "seq": 2048,
            "compiled": True, "kernels": "loss,rotary,norms",
            "model": {"n_layers": 24, "d_model": 2048}}
    rows = [line, {**line, "kernels": "loss,rotary,norms,fp8", "tokens_per_s": 150.0},
            {**line, "engine": "fsdp2", "tokens_per_s": 90.0},
            {**line, "model": {"n_layers": 12, "d_model": 2048},
             "tokens_per_s": 200.0}]
    (folder / "2026-01-02-run1-x.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    found = results.load_results(tmp_path)
    assert sorted((k.workload, k.engine, k.fp8) for k in found) == [
        ("W1", "fsdp2", False), ("W1", "labml_zero", False),
        ("W1", "labml_zero", True), ("W1 L12", "labml_zero", False)]
    assert results.lookup(found, "W1 labml_zero compiled gpus=1 tokens_per_s")[0] \
        == "100 tokens/s"
    value, key = results.lookup(found, "W1 labml_zero compiled fp8 gpus=1 tokens_per_s")
    assert value == "150 tokens/s" and key.anchor.endswith("-fp8-h100")
    best = results.best_settings(found)[("W1", "h100", 1, 8)]
    assert best["labml_zero"].line["tokens_per_s"] == 100.0
    page = results.results_markdown(found)
    assert "fp8 products |" in page and "--layers 12" in page
    # half the layers: the same tokens/s would be about half the MFU
    full, half = (results.line_mfu({**line, "tokens_per_s": 1e4}),
                  results.line_mfu({**rows[3], "tokens_per_s": 1e4}))
    assert 0.4 < half / full < 0.6


def test_results_keep_a_recomputation_other_than_the_workloads_apart(tmp_path):
    """W1 recomputed (`bench.run --recompute yes`) is a configuration of its
    own: the later grid line does not replace W1's plain line of the same
    batch; W2-1 recomputed, as its workload does, keeps its plain key."""
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    line = {"engine": "labml_zero", "workload": "W1", "world_size": 1,
            "status": "ok", "tokens_per_s": 100.0, "peak_mem_gib": 1.0,
            "step_time_mean_s": 1.0, "step_time_std_s": 0.1, "loss": 2.0,
            "device": "NVIDIA H100 80GB HBM3", "batch_per_gpu": 8, "seq": 2048,
            "compiled": True, "kernels": "loss,rotary,norms",
            "activation_checkpointing": False,
            "model": {"n_layers": 24, "d_model": 2048}}
    rows = [line, {**line, "activation_checkpointing": True, "tokens_per_s": 80.0},
            {**line, "workload": "W2-1", "activation_checkpointing": True,
             "model": {"n_layers": 32, "d_model": 4096}}]
    (folder / "2026-01-02-run1-x.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    found = results.load_results(tmp_path)
    assert [(k.workload, k.recompute) for k in found] == [
        ("W1", None), ("W1", True), ("W2-1", None)]
    assert results.lookup(found, "W1 labml_zero compiled gpus=1 tokens_per_s")[0] \
        == "100 tokens/s"
    value, key = results.lookup(
        found, "W1 labml_zero compiled recompute gpus=1 tokens_per_s")
    assert value == "80 tokens/s" and key.anchor.endswith("-recompute-h100")
    page = results.results_markdown(found)
    assert "recomputed |" in page and "--recompute yes" in page


def test_results_keep_each_kind_of_gpu_and_prefetch_depth_apart(tmp_path):
    """A later H100 line of a configuration does not replace the H200's, nor a
    labml_zero line at prefetch depth 3 the one at depth 1 (a peer's depth
    flag is ignored); a note must name the GPU where both were measured, and
    each kind of GPU has its own best settings."""
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    line = {"engine": "labml_zero", "workload": "W1", "world_size": 1,
            "status": "ok", "tokens_per_s": 100.0, "peak_mem_gib": 1.0,
            "step_time_mean_s": 1.0, "step_time_std_s": 0.1, "loss": 2.0,
            "device": "NVIDIA H200", "batch_per_gpu": 8, "seq": 2048,
            "compiled": True, "prefetch_depth": 1}
    h100 = {**line, "device": "NVIDIA H100 80GB HBM3"}
    (folder / "2026-01-02-run1-x.jsonl").write_text(
        json.dumps(line) + "\n"
        + json.dumps({**line, "engine": "fsdp2", "tokens_per_s": 90.0}) + "\n")
    (folder / "2026-01-03-run1-x.jsonl").write_text(
        json.dumps({**h100, "tokens_per_s": 80.0}) + "\n"
        + json.dumps({**h100, "prefetch_depth": 3, "tokens_per_s": 85.0}) + "\n"
        + json.dumps({**h100, "engine": "fsdp2", "prefetch_depth": 3,
                      "tokens_per_s": 70.0}) + "\n")
    found = results.load_results(tmp_path)
    assert sorted((k.engine, k.gpu, k.depth) for k in found) == [
        ("fsdp2", "h100", 1), ("fsdp2", "h200", 1), ("labml_zero", "h100", 1),
        ("labml_zero", "h100", 3), ("labml_zero", "h200", 1)]
    with pytest.raises(BuildError, match=r"GPUs \['h100', 'h200'\]; add gpu=NAME"):
        results.lookup(found, "W1 labml_zero compiled gpus=1 tokens_per_s")
    assert results.lookup(
        found, "W1 labml_zero compiled gpus=1 gpu=h200 tokens_per_s")[0] == "100 tokens/s"
    value, key = results.lookup(
        found, "W1 labml_zero compiled gpus=1 gpu=h100 depth=3 tokens_per_s")
    assert value == "85 tokens/s" and key.anchor.endswith("-h100-depth3")
    best = results.best_settings(found)
    assert best[("W1", "h200", 1, 8)]["labml_zero"].line["tokens_per_s"] == 100.0
    h100_best = best[("W1", "h100", 1, 8)]["labml_zero"]
    assert results.setting(h100_best.key) == "compiled + prefetch depth 3"
    page = results.results_markdown(found)
    assert "| W1 | 1 × H100 | 8 | labml_zero |" in page
    assert "--prefetch-depth 3" in page


def test_results_keep_and_name_each_optimizer_state_layout(tmp_path):
    """A labml_zero line with bf16 moments is a configuration of its own beside
    the fp32 one (a line without the field kept fp32), named in its settings,
    its best setting and its command, and picked by `states=`."""
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    line = {"engine": "labml_zero", "workload": "W2-1", "world_size": 1,
            "status": "ok", "tokens_per_s": 100.0, "peak_mem_gib": 1.0,
            "step_time_mean_s": 1.0, "step_time_std_s": 0.1, "loss": 2.0,
            "device": "GPU", "batch_per_gpu": 8, "seq": 2048}
    rows = [line, {**line, "optimizer_states": "bf16-moments",
                   "tokens_per_s": 120.0},
            {**line, "engine": "fsdp2", "optimizer_states": "fp32",
             "tokens_per_s": 110.0}]
    (folder / "2026-01-02-run1-x.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    found = results.load_results(tmp_path)
    assert sorted(k.states for k in found) == ["bf16-moments", "fp32", "fp32"]
    assert results.lookup(found, "W2-1 labml_zero gpus=1 tokens_per_s")[0] == (
        "100 tokens/s")
    value, key = results.lookup(
        found, "W2-1 labml_zero gpus=1 states=bf16-moments tokens_per_s")
    assert value == "120 tokens/s"
    assert key.anchor == "result-w2-1-labml_zero-1gpu-b8-bf16-moments"
    best = results.best_settings(found)[("W2-1", "", 1, 8)]
    assert results.setting(best["labml_zero"].key) == "eager + bf16-moments states"
    page = results.results_markdown(found)
    assert "| 2.00 | bf16-moments optimizer states |" in page
    assert "--batch 8 --optimizer-states bf16-moments`" in page
    # the fp32 lines' commands name no layout
    assert page.count("--engines labml_zero --world-size 1 --batch 8`") == 1
    assert page.count("--engines fsdp2 --world-size 1 --batch 8`") == 1


def test_measured_figures_on_the_site_come_from_the_data(site_files):
    found = results.load_results(REPO)
    home = site_files["index.html"].decode()
    m = found[results.Key("W2", "labml_zero", False, 2, 2, gpu="h200")]
    assert f"{m.line['tokens_per_s']:,.0f} tokens/s</a>" in home
    assert "| workload | labml_zero | FSDP2 |" not in home  # no benchmark table
    page = site_files["results.html"].decode()
    for key, m in found.items():
        assert f'id="{key.anchor}"' in page
        if m.line.get("status") == "ok":
            assert f"{m.line['tokens_per_s']:,.0f}" in page


def test_py_directive_evaluates_only_the_whitelist(tmp_path):
    assert evaluate("math.floor(2.5) * 2", "p") == 4
    for bad, msg in (("open('x')", "'open' is not one of"),
                     ("math.__dict__", "private"),
                     ("[x for x in ()]", "ListComp")):
        with pytest.raises(BuildError, match=msg):
            evaluate(bad, "p")
    d = Directives(REPO, {})
    assert d.expand("{{py: math.factorial(10)}} and {{py: math.pi | .3f}}",
                    "p") == "3,628,800 and 3.142"
    with pytest.raises(BuildError, match="is a float; give a format"):
        d.expand("{{py: math.pi}}", "p")
    with pytest.raises(BuildError, match="no such test function"):
        d.cite("(tested: tests/docs/test_builder.py::test_nothing)", "p")
    with pytest.raises(BuildError, match="no such file"):
        d.cite("(tested: tests/none.py::test_x)", "p")


def _mark(*tests: str) -> str:
    """The mark `cite` gives on page a/p.html for tests of this file."""
    where = "tests/docs/test_builder.py"
    lines = (REPO / where).read_text().splitlines()
    links = []
    for test in tests:
        line = next(i for i, text in enumerate(lines, start=1)
                    if text.startswith(f"def {test}("))
        links.append(f'<a href="../source/{where}.html#L{line}" '
                     f'title="asserted by {where}::{test}" '
                     f'aria-label="asserted by {where}::{test}">✓</a>')
    return f'<sup class="tested">{"".join(links)}</sup>'


def test_citations_are_marks_after_the_sentence_linking_to_the_test():
    d = Directives(REPO, {})
    tag = "(tested: tests/docs/test_builder.py::{})"
    a, b = "test_citations_are_marks_after_the_sentence_linking_to_the_test", \
        "test_no_formula_is_left_as_raw_tex"
    # Out of the sentence, after its end; one mark per distinct test.
    assert d.cite(f"costs 18 {tag.format(a)} bytes, not 16\n{tag.format(b)} "
                  f"(e.g. `x. y`, $1.5$). Then", "a/p.html") == (
        f"costs 18 bytes, not 16 (e.g. `x. y`, $1.5$).{_mark(a, b)} Then")
    assert d.cite(f"26 {tag.format(a)}, 34 {tag.format(a)} and 30 {tag.format(a)}.",
                  "a/p.html") == f"26, 34 and 30.{_mark(a)}"
    # The end of a paragraph, a list item or a table cell comes first.
    assert d.cite(f"* 12 {tag.format(a)} bytes\n* next", "a/p.html") == (
        f"* 12 bytes{_mark(a)}\n* next")
    assert d.cite(f"| 12 {tag.format(a)} | x |", "a/p.html") == (
        f"| 12{_mark(a)} | x |")
    assert d.cite(f"## Costs 18 {tag.format(a)} bytes\nThen more.", "a/p.html") == (
        f"## Costs 18 bytes{_mark(a)}\nThen more.")
    # After a display formula: on its own line (the page puts it at the right).
    assert d.cite(f"$$a = 12$$\n{tag.format(a)}\n\nNext.", "a/p.html") == (
        f"$$a = 12$$\n{_mark(a)}\n\nNext.")
    # A tag shown as code is an example, not a citation.
    assert d.cite("write `(tested: tests/x.py::test_y)` after it", "p") == (
        "write `(tested: tests/x.py::test_y)` after it")


def test_the_tests_are_source_pages_that_the_marks_link_to(site_files):
    page = site_files["source/tests/docs/test_builder.py.html"].decode()
    assert 'id="L1"' in page and "def test_citations_are_marks" in page
    marks = [(page_out, href) for page_out, data in site_files.items()
             if page_out.endswith(".html") and not page_out.startswith("source/")
             for href in re.findall(r'<sup class="tested"><a href="([^"]+)"',
                                    data.decode())]
    assert len(marks) > 50
    for page_out, href in marks:
        target, _, anchor = href.partition("#")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page_out),
                                                   target))
        assert f'id="{anchor}"' in site_files[target].decode(), (page_out, href)
    assert "(tested:" not in "".join(
        visible_text(d.decode()) for p, d in site_files.items()
        if p.endswith(".html") and not p.startswith("source/"))


def test_glossary_links_terms_to_their_definition(tmp_path, site_files):
    glossary = site_files["glossary.html"].decode()
    for term in ("chunk", "shard", "unit", "gather stream", "reduce dtype",
                 "prefetch depth", "placement", "W1", "W5"):
        assert f'id="glossary-{build_docs.slugify(term)}"' in glossary, term
    # W1..W5 are defined on the Results page, from the data.
    assert 'href="results.html#term-w1"' in glossary
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "docs_src", tree / "docs_src")
    (tree / "docs_src" / "index.md").write_text("# Home\n")  # defines no term
    shutil.copytree(REPO / "bench" / "results", tree / "bench" / "results")
    (tree / "labml_zero" / "zero3").mkdir(parents=True)
    shutil.copy(REPO / "labml_zero" / "zero3" / "chunk_layout.py",
                tree / "labml_zero" / "zero3")
    (tree / "labml_zero" / "__init__.py").write_text(
        '"""\n# Root\n\nA {{term: chunks | chunk}} is a buffer.\n"""\n')
    (tree / "docs_src" / "reading_order.txt").write_text(
        "labml_zero/__init__.py\nlabml_zero/zero3/chunk_layout.py\n"
        "@results\n@glossary\n")
    files = build_docs.build_site(tree)
    root_page = files["labml_zero/index.html"].decode()
    assert '<dfn id="term-chunk">chunks</dfn>' in root_page
    assert 'href="labml_zero/index.html#term-chunk"' in files["glossary.html"].decode()
    (tree / "labml_zero" / "a.py").write_text('"""\n# A\n\n{{term: chunk}}\n"""\n')
    (tree / "docs_src" / "reading_order.txt").write_text(
        "labml_zero/__init__.py\nlabml_zero/a.py\n"
        "labml_zero/zero3/chunk_layout.py\n@results\n@glossary\n")
    with pytest.raises(BuildError, match="'chunk' is defined on"):
        build_docs.build_site(tree)


def test_no_formula_is_left_as_raw_tex():
    from docsite.markdown import Renderer

    renderer = Renderer({"p.html"}, {})
    # A table cell whose text ends in a digit (dollarmath read src[-1] at pos 0).
    table = renderer.render("| a | b |\n|---|---|\n| $p$, 4, 4 | $q$ |\n",
                            "p.html", set())
    assert table.count("<math") == 2 and "$" not in table
    # An inline formula wrapped onto a line starting with "+" (a list item).
    wrapped = renderer.render("$x + a(x)\n   + b(x)$.\n", "p.html", set())
    assert wrapped.count("<math") == 1 and "<li>" not in wrapped
    assert "$5 or $10" in renderer.render("costs $5 or $10\n", "p.html", set())
    # What still gets through as text stops the build.
    with pytest.raises(BuildError, match=r"p\.html: TeX left as text"):
        renderer.render("`a` \\\\alpha b\n", "p.html", set())


def test_results_restate_mfu_on_the_data_sheet_and_pick_each_best(tmp_path):
    """A line's own `mfu` (790 TFLOP/s in older lines) is not what the page
    shows: MFU is recomputed from tokens/s and the workload's FLOPs per token
    over the data sheet's 989.4 TFLOP/s. Each engine is compared at its fastest
    configuration, named."""
    from bench.workloads import flops_per_token, workloads

    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    w1 = workloads()["W1"]
    line = {"workload": "W1", "world_size": 1, "status": "ok", "mfu": 0.68,
            "tokens_per_s": 59.2e3, "peak_mem_gib": 1.0, "step_time_mean_s": 1.0,
            "step_time_std_s": 0.1, "loss": 2.0, "device": "NVIDIA H200",
            "batch_per_gpu": 8, "seq": 2048, "finetune": "all",
            "model": {"n_layers": 24, "d_model": 2048, "n_heads": 16,
                      "n_vocab": 50304}}
    rows = [{**line, "engine": "labml_zero", "tokens_per_s": 59.2e3},
            {**line, "engine": "labml_zero", "compiled": True,
             "tokens_per_s": 62.0e3},
            {**line, "engine": "ddp", "tokens_per_s": 50.0e3},
            {**line, "engine": "ddp", "compiled": True, "tokens_per_s": 61.0e3}]
    (folder / "2026-01-02-run1-x.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    found = results.load_results(tmp_path)
    expected = 100 * flops_per_token(w1) * 59.2e3 / 989.4e12
    assert results.lookup(found, "W1 labml_zero gpus=1 mfu")[0] == f"{expected:.1f}%"
    assert expected < 55  # the line's own 68% is not what the page shows
    best = results.best_settings(found)[("W1", "h200", 1, 8)]
    assert {e: results.setting(m.key) for e, m in best.items()} == {
        "labml_zero": "compiled", "ddp": "compiled"}
    page = results.results_markdown(found)
    assert "| W1 | 1 × H200 | 8 | ddp | [compiled](#result-w1-ddp-compiled-1gpu-b8-h200), " \
           "kernels none | 61,000 |" in page and f"| {61 / 62:.3f} |" in page
    # a CPU line, or a GPU not in the table, has no MFU
    assert results.line_mfu({**line, "device": "cpu"}) is None
