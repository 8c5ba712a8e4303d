"""The built site: one page per module, links that resolve, offline assets, `--check`,
figures from real inputs, and math that headless Chromium renders from file://."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import build_docs  # noqa: E402
import docsite.cli  # noqa: E402


@pytest.fixture(scope="module")
def site(built_site) -> Path:
    return built_site


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id":
                self.ids.add(value)
            if name in ("href", "src") and value is not None:
                self.refs.append((tag, name, value))


def _parse(path: Path) -> _Refs:
    parser = _Refs()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def test_every_module_has_a_page_and_a_source_page(site):
    modules = build_docs.discover_modules(REPO)
    assert "labml_zero/__init__.py" in modules
    for rel in modules:
        assert (site / build_docs.module_page(rel)).is_file(), rel
        source_page = site / "source" / f"{rel}.html"
        assert source_page.is_file(), rel
        # the whole file is on its source page, one anchor per line (no raw
        # copy of the package is kept in site/: the highlighted page is it)
        n_lines = len((REPO / rel).read_text().splitlines())
        html = source_page.read_text()
        assert f'id="L{n_lines}"' in html and f'id="L{n_lines + 1}"' not in html, rel
        assert not (site / "source" / rel).exists(), rel
    assert (site / "labml_zero" / "zero3" / "chunk_layout.html").is_file()


def test_every_internal_link_and_asset_resolves(site):
    ids = {}
    pages = sorted(site.rglob("*.html"))
    for page in pages:
        ids[page] = _parse(page).ids
    checked = 0
    for page in pages:
        for tag, attr, value in _parse(page).refs:
            if re.match(r"^[a-z][a-z0-9+.-]*:", value):
                continue
            path, _, fragment = value.partition("#")
            target = (page.parent / path).resolve() if path else page
            assert target.is_file(), f"{page.relative_to(site)}: {tag} {attr}={value}"
            assert site.resolve() in target.parents, f"{page}: {value} leaves site/"
            if fragment and target.suffix == ".html":
                assert fragment in ids[target], f"{page.relative_to(site)}: {value}"
            checked += 1
    assert checked > 100


def test_no_page_loads_anything_remote(site):
    for page in site.rglob("*.html"):
        for tag, attr, value in _parse(page).refs:
            if tag in ("script", "link", "img", "iframe", "source"):
                assert not re.match(r"^(https?:)?//", value), f"{page}: {value}"
        # The one script is the calculator's, shipped in static/ (its data is
        # JSON, not code); no page runs anything else.
        for script in re.findall(r"<script[^>]*>", page.read_text(encoding="utf-8")):
            assert re.fullmatch(r'<script (type="application/json" id="calc-data"|'
                                r'src="(\.\./)*static/calculator(_form)?\.js")>',
                                script), f"{page}: {script}"


def test_build_is_deterministic(site_files):
    assert build_docs.build_site(REPO) == site_files


def test_check_detects_stale_missing_and_extra_files(tmp_path, capsys, site_files,
                                                     monkeypatch):
    files = site_files
    # In process, `--check` compares with the session's build (building is
    # `test_build_is_deterministic`'s); the command line below builds its own.
    monkeypatch.setattr(docsite.cli, "build_site", lambda repo: files)
    build_docs.write_site(tmp_path, files)
    assert build_docs.main(["--check", "--site", str(tmp_path)]) == 0
    (tmp_path / "labml_zero" / "index.html").write_text("stale")
    (tmp_path / "static" / "site.css").unlink()
    (tmp_path / "labml_zero" / "gone.html").write_text("a removed module's page")
    capsys.readouterr()
    assert build_docs.main(["--check", "--site", str(tmp_path)]) == 1
    listed = capsys.readouterr().out
    for rel in ("labml_zero/index.html", "static/site.css", "labml_zero/gone.html"):
        assert f"  {rel}\n" in listed
    # Writing repairs it, removing the page of a module that no longer exists.
    build_docs.write_site(tmp_path, files)
    assert build_docs.stale_files(tmp_path, files) == []
    assert not (tmp_path / "labml_zero" / "gone.html").exists()
    # The command line reports the same through its exit status.
    (tmp_path / "index.html").write_text("stale")
    proc = subprocess.run(
        [
            sys.executable, str(REPO / "build_docs.py"),
            "--check", "--site", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1 and "  index.html\n" in proc.stdout


def _load_diagrams():
    return build_docs._load_path("_diagrams_test", REPO / "docs_src" / "diagrams.py")


def test_chunk_layout_figure_is_plan_chunks_on_pythia_160m(site):
    diagrams = _load_diagrams()
    layout_mod = diagrams._load_chunk_layout(REPO)
    shapes = diagrams.pythia_160m_shapes()
    # Pythia-160M's parameter count at vocabulary 50432 (untied readout, no bias).
    d, v = 768, 50432
    per_layer = (
        3 * d * d + 3 * d + d * d + d + 4 * d + 4 * d * d + 4 * d + 4 * d * d + d
    )
    total = sum(diagrams._numel(s) for _, s, _ in shapes)
    assert total == 2 * v * d + 12 * per_layer + 2 * d
    svg = (site / "figures" / "chunk_layout.svg").read_text()
    for size in (2**22, 2**23):
        specs = [layout_mod.ParamSpec(n, s, True, g) for n, s, g in shapes]
        layout = layout_mod.plan_chunks(specs, size, 2)
        padding = layout.padding()
        assert f"{len(layout.chunks)} chunks, padding {padding:,} elements" in svg
        assert svg.count("<title>chunk ") >= len(layout.chunks)


def test_timeline_figure_comes_from_the_trace_file(site):
    diagrams = _load_diagrams()
    trace_path = REPO / "docs_src" / "figures" / "step_timeline.json"
    trace = json.loads(trace_path.read_text())
    svg = (site / "figures" / "step_timeline.svg").read_text()
    assert svg.count("<g><title>") == len(trace["events"])
    assert trace["source"][:40] in svg
    with pytest.raises(ValueError, match="stream 'copy'"):
        diagrams.validate_trace(
            {
                "source": "x",
                "events": [{"name": "a", "stream": "copy", "start": 0, "end": 1}],
            }
        )
    with pytest.raises(ValueError, match="start <= end"):
        diagrams.validate_trace(
            {
                "source": "x",
                "events": [
                    {"name": "a", "stream": "gather", "start": 2, "end": 1}
                ],
            }
        )


def _fake_tree(root: Path) -> None:
    """A tiny package whose pages cite each other's notes."""
    shutil.copytree(REPO / "docs_src", root / "docs_src",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the real home page links terms this tiny package does not define
    (root / "docs_src" / "index.md").write_text("# Home\n\n{{reading_order}}\n")
    shutil.copytree(REPO / "bench" / "results", root / "bench" / "results")
    pkg = root / "labml_zero" / "zero3"
    pkg.mkdir(parents=True)
    shutil.copy(REPO / "labml_zero" / "zero3" / "chunk_layout.py", pkg)
    (root / "labml_zero" / "__init__.py").write_text(
        '"""\n---\ntitle: Root\nsummary: The root.\n---\n\n# Root\n\n'
        'Read [chunks](zero3/chunk.html) and [later](zero3/missing.html).\n"""\n'
    )
    (pkg / "chunk.py").write_text(
        'r"""\n---\ntitle: Chunk\nsummary: A chunk.\n---\n\n# Chunk\n\n'
        "Each rank holds $\\frac{(2+2+K)\\Psi}{N_d}$ bytes, "
        "and a price of $5 is text.\n\n"
        "![chunk layout](figures/chunk_layout.svg)\n\n"
        "## Note: why storage resize\n\nViews must survive.\n\n"
        '## Limitations\n\nNone.\n"""\n\nHOME = "$HOME"  # not math\n\n\n'
        "def gather(x):\n"
        "    # Regrow it (see Note: why storage resize).\n"
        "    return x\n"
    )
    (pkg / "hooks.py").write_text(
        '"""\n# Hooks\n\nSee [the chunk](chunk.py).\n"""\n\n\n'
        "def release(x):\n    # Shrink, see Note: why storage resize.\n    return x\n"
    )
    (pkg / "broken.py").write_text("def half_written(:\n")
    (root / "docs_src" / "reading_order.txt").write_text(
        "## First\nlabml_zero/zero3/chunk.py\nlabml_zero/__init__.py\n"
        "## Then\nlabml_zero/zero3/chunk_layout.py\nlabml_zero/zero3/hooks.py\n"
        "labml_zero/zero3/broken.py\n@results\n@glossary\n"
    )


def test_notes_link_across_pages_and_broken_files_still_get_a_page(tmp_path):
    _fake_tree(tmp_path)
    files = build_docs.build_site(tmp_path)
    hooks = files["labml_zero/zero3/hooks.html"].decode()
    chunk = files["labml_zero/zero3/chunk.html"].decode()
    root = files["labml_zero/index.html"].decode()
    assert '<a href="chunk.html#note-why-storage-resize">' in hooks
    assert '<a href="chunk.html">the chunk</a>' in hooks
    assert '<a href="#note-why-storage-resize">' in chunk
    assert 'id="note-why-storage-resize"' in chunk
    assert '<meta name="description" content="A chunk.">' in chunk
    assert "<title>Chunk · labml_zero</title>" in chunk
    assert '<a href="zero3/chunk.html">chunks</a>' in root
    assert '<span class="missing" title="page not written yet">later</span>' in root
    assert "does not parse yet" in files["labml_zero/zero3/broken.html"].decode()
    # Reading order: home, then docs_src/reading_order.txt's order (chunk first).
    index = files["index.html"].decode()
    assert 'class="next" href="labml_zero/zero3/chunk.html"' in index
    assert 'class="prev" href="../../index.html"' in chunk


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed: apt-get install -y chromium")


def _chromium_run(page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp}",
        "--window-size=1400,1000", *extra, page.resolve().as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _visible_text(dom: str) -> str:
    for tag in ("pre", "code", "math", "script", "style", "title"):
        dom = re.sub(rf"<{tag}\b.*?</{tag}>", " ", dom, flags=re.S)
    return re.sub(r"<[^>]+>", " ", dom)


def test_chromium_renders_math_from_file_urls(tmp_path):
    _fake_tree(tmp_path / "tree")
    site = tmp_path / "site"
    build_docs.write_site(site, build_docs.build_site(tmp_path / "tree"))
    page = site / "labml_zero" / "zero3" / "chunk.html"

    proc = _chromium_run(page, tmp_path / "profile", "--dump-dom")
    dom = proc.stdout
    assert proc.returncode == 0 and "</html>" in dom, proc.stderr[-2000:]
    assert dom.count("<math") >= 1 and "<mfrac>" in dom
    text = _visible_text(dom)
    assert not re.search(r"\$[^\s$][^$]*[^\s$]\$", text), "raw $...$ left in the page"
    assert "price of $5 is text" in text
    assert '"$HOME"' in dom  # the code column keeps its dollar sign

    png = tmp_path / "page.png"
    proc = _chromium_run(page, tmp_path / "profile2", f"--screenshot={png}")
    assert png.is_file(), proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_no_page_of_the_built_site_shows_raw_tex(site_files):
    from docsite.markdown import raw_tex_left

    left = {page: raw_tex_left(data.decode()) for page, data in site_files.items()
            if page.endswith(".html") and not page.startswith("source/")}
    assert len(left) > 50
    assert not {p: t for p, t in left.items() if t}
