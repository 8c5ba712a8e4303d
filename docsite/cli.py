"""
---
title: Writing and checking the site
summary: python build_docs.py writes site/; --check lists stale files.
---

# Writing and checking the site

    python build_docs.py                 write site/
    python build_docs.py --check         exit 1 and list stale files if site/ differs
    python build_docs.py --site DIR      use DIR instead of site/

A build error (a module missing from the reading order, a formula that does not
convert, a directive that does not evaluate) is one line naming the page and the
thing, and nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .paths import DEFAULT_SITE, REPO, BuildError
from .site import build_site


def stale_files(site: Path, files: dict[str, bytes]) -> list[str]:
    """Files that differ, are missing from `site`, or should not be there."""
    stale = []
    for rel, data in files.items():
        path = site / rel
        if not path.is_file() or path.read_bytes() != data:
            stale.append(rel)
    if site.is_dir():
        for path in site.rglob("*"):
            if path.is_file() and path.relative_to(site).as_posix() not in files:
                stale.append(path.relative_to(site).as_posix())
    return sorted(stale)


def write_site(site: Path, files: dict[str, bytes]) -> list[str]:
    changed = stale_files(site, files)
    for rel in changed:
        path = site / rel
        if rel not in files:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees a half-written page.
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(files[rel])
        os.replace(tmp.name, path)
    for path in sorted(site.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the notes site: every module of labml_zero/ as a "
                    "two-column page.")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 listing stale files")
    parser.add_argument("--site", type=Path, default=DEFAULT_SITE,
                        help="output folder (default: site/)")
    args = parser.parse_args(argv)
    try:
        files = build_site(REPO)
    except ModuleNotFoundError as e:
        # The renderers are the `docs` extra, not runtime dependencies.
        print(f"build_docs.py: missing {e.name!r}; install the docs extra "
              "(`pip install -e '.[docs]'`, or `bash setup.sh test`)", file=sys.stderr)
        return 2
    except BuildError as e:
        print(f"build_docs.py: {e}", file=sys.stderr)
        return 1
    if args.check:
        stale = stale_files(args.site, files)
        if stale:
            print(f"{args.site} is stale; run `python build_docs.py`. Stale files:")
            for rel in stale:
                print(f"  {rel}")
            return 1
        print(f"{args.site} is up to date ({len(files)} files)")
        return 0
    changed = write_site(args.site, files)
    print(f"wrote {len(changed)} of {len(files)} files to {args.site}")
    return 0
