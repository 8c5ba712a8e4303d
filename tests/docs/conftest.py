"""One build of the repository's site, shared by the docs tests (a build takes
seconds; the suite should not pay for it in every test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import build_docs  # noqa: E402


@pytest.fixture(scope="session")
def site_files() -> dict[str, bytes]:
    return build_docs.build_site(REPO)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory, site_files) -> Path:
    out = tmp_path_factory.mktemp("site")
    build_docs.write_site(out, site_files)
    return out
