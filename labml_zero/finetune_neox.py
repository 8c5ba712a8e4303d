"""
---
title: The fine-tune's entry point
summary: Keeps `python -m labml_zero.finetune_neox` working; the command line
  itself is the fine-tune package's page.
---

# The fine-tune's entry point

Runs [the fine-tune's command line](finetune/cli.html).
"""

import sys

from labml_zero.finetune.cli import main

# The command's exit status is `main`'s: 0, 1 when a rank failed, 2 for bad
# input found before any process starts, the shell's status for a signal.
if __name__ == "__main__":
    sys.exit(main())
