"""The notes read as a textbook: no raw TeX, introductions within budget, no lab
traces, and no number that nothing checks, beyond each check's allowlist in
docs_src/unchecked/ (what the notes had when the check was written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from docsite import lint
from docsite.paths import BuildError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def found(site_files):
    return lint.findings(REPO, site_files)


@pytest.mark.parametrize("check", lint.CHECKS)
def test_no_new_findings(found, check):
    allowed = lint.read_allowlist(REPO, check)
    new = [f for f in found[check] if f not in allowed]
    assert not new, (f"{check}: fix these, or see docsite/lint.py:\n"
                     + "\n".join(new[:30]))


def test_the_checks_find_what_they_are_for():
    assert lint.numbers("costs 18 bytes, 3.5 GiB; W1 uses fp32 on 2 ranks") == [
        "18", "3.5"]
    assert lint.numbers("{{py: x}} and 12 (tested: tests/a.py::test_b)") == []
    assert lint.numbers("$12h^2 + 13h$ (tested: tests/a.py::test_b), 16 more") == [
        "16"]
    assert lint.numbers("$$P = 12h^2L$$\n\n(tested: tests/a.py::test_b)") == []
    assert lint.numbers("$$a = 12$$ then $$b = 13$$ (tested: tests/a.py::test_b)"
                        ) == ["12"]
    assert lint.numbers("$12h^2$ and 13 words (tested: tests/a.py::test_b)") == [
        "12"]
    assert lint.numbers("`x = 42` and [link](a/run42.html)") == []
    assert lint.intro_words("one two $$x y z$$ three `a b`") == 3
    assert "run18" in str([p.findall("as in run18") for p in lint.LAB_TRACES])
    assert any(p.search("went from 10.8k to 12.0k") for p in lint.LAB_TRACES)


def test_names_flags_files_and_constants_resolve_against_the_code():
    from docsite.code_refs import Checker
    from docsite.directives import Directives

    page = "labml_zero/zero3/x.py"
    good = ("`Chunk.gather(async_op=True)` `ChunkState.GATHERED` "
            "`torch.cuda.synchronize()` `dist.all_gather_into_tensor` "
            "`memory_model.zero_model_states` `prefetch_depth` `self.full` "
            "`--seq-len 128` `docs_src/glossary.txt` `chunk.py` `tests/docs/` "
            "`AdamFP16(free_grads=True)` `x + 1` `python build_docs.py --check`")
    bad = ("`LocalShard.add_grad` `add_grad(reduced)` `torch.cuda.nosuch` "
           "`memory_model.nosuch` `main_grad` `--nope` `nosuch.py`")
    found = Checker(REPO).check({page: good, "p2": bad + (
        " `BACKWARD_EXTRA_UNITS = 1` and `OPTIMIZER_BYTES` = 12")})
    assert not [f for f in found["names"] if f.startswith(page)], found["names"]
    assert sorted(f.split("`")[1] for f in found["names"]) == sorted(
        s.strip("`") for s in bad.split())
    assert sorted(found["constants"]) == [
        "p2 | `BACKWARD_EXTRA_UNITS = 1` restated (the code says 0); write "
        "{{const: BACKWARD_EXTRA_UNITS}}",
        "p2 | `OPTIMIZER_BYTES` 12 restated (matches); write "
        "{{const: OPTIMIZER_BYTES}}"]
    # The directive that replaces a restatement reads the value from the code.
    assert Directives(REPO, {}).expand("{{const: BACKWARD_EXTRA_UNITS}}", "p") == (
        "<code>BACKWARD_EXTRA_UNITS = 0</code>")


def test_a_listed_symbol_keeps_its_one_meaning(tmp_path):
    from docsite import notation

    (tmp_path / "docs_src").mkdir()
    (tmp_path / notation.NOTATION_FILE).write_text(
        "$K$ | optimizer bytes | optimizer, adam, byte\n"
        "$N_s$ | ranks of a shard group | rank, group\n")
    notes = {
        "ok": "where $K$ is the optimizer's bytes; $N_{s}$ ranks; the group size "
              "$N_s$, and $q$ ranks (not listed).\n\n* $K$: the Adam state's bytes",
        "bad": "the shard group of $K$ ranks.\n\nwhere $N_s$ is the loss scale",
    }
    assert sorted(notation.check(tmp_path, notes)) == [
        'bad | $K$ "ranks" (notation: optimizer bytes)',
        'bad | $N_s$ "the loss scale" (notation: ranks of a shard group)']
    table = notation.table_markdown(notation.read_table(tmp_path))
    assert "| $K$ | optimizer bytes |" in table
    (tmp_path / notation.NOTATION_FILE).write_text("$K$ | a | b\n$K$ | c | d\n")
    with pytest.raises(BuildError, match="listed twice"):
        notation.read_table(tmp_path)


def test_the_glossary_page_shows_the_notation_table(site_files):
    page = site_files["glossary.html"].decode()
    assert 'id="notation"' in page and page.count("<math") >= 10


def test_the_repository_table_catches_the_two_symbols_it_once_missed():
    """`d` meant the prefetch depth on some pages and the hidden size on others,
    and $\\Psi$ all parameters in one place and the trainable ones in another: the
    book's own table now gives each one meaning, and the check refuses the
    second."""
    from docsite import notation

    notes = {"bad": "Units are gathered to the prefetch depth $d$.\n\n"
                    "A model of $\\Psi$ trainable parameters.",
             "ok": "The hidden size $d$; a model of $\\Psi$ parameters; where $D$ "
                   "is the prefetch depth, and $\\Psi_t$ trainable parameters."}
    found = sorted(f.split(" (notation")[0] for f in notation.check(REPO, notes))
    assert found == ['bad | $\\Psi$ "trainable parameters" names another symbol',
                     'bad | $d$ "prefetch depth"']
