"""
---
title: python -m labml_zero.app
summary: Runs the app's server, so that `python -m labml_zero.app` starts it.
---

# `python -m labml_zero.app`

Starts [the app's server](server.html); `labml-zero-app` is the same command.
"""

from labml_zero.app.server import main

# `python -m` runs this module as `__main__`; nothing imports it otherwise.
main()
