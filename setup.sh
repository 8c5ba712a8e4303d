#!/usr/bin/env bash
# Set up .venv for labml_zero on a fresh machine.
#   bash setup.sh          the package, what the fine-tune needs and the labml
#                          app its runs are tracked in (the app extra)
#   bash setup.sh test     also the test and docs extras, and Chromium for
#                          the tests that render the notes and the labml app
# torch goes in first, by exact version, so that pip takes the CPU build this
# machine keeps on disk instead of downloading a multi-GB CUDA build. Where torch
# is already importable (a GPU image), it is left alone.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! $py -c "import torch" 2>/dev/null; then
    $py -m pip install -q "torch==${LABML_ZERO_TORCH:-2.13.0}"
fi
extras="[app]"
if [ "${1:-}" = "test" ]; then
    extras="[test,docs,app]"
    if ! command -v chromium >/dev/null 2>&1; then
        if [ "$(id -u)" = "0" ]; then
            apt-get update -qq >/dev/null && \
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
        else
            echo "setup.sh: install Debian's chromium (sudo apt-get install chromium)" \
                 "for the notes' rendering test" >&2
        fi
    fi
fi
$py -m pip install -q -e ".${extras}"
