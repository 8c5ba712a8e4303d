"""
Build the notes site: every module of `labml_zero/` as a two-column page.

    python build_docs.py                 write site/
    python build_docs.py --check         exit 1 and list stale files if site/ differs
    python build_docs.py --site DIR      use DIR instead of site/

The builder is the `docsite` package (its `__init__` lists its files); this file
is the command and keeps the names the tests and scripts import.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docsite import *  # noqa: E402,F401,F403 -- the builder's public names
from docsite import _load_path, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
