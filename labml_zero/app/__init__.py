"""
---
title: The labml app
summary: labml-app on this machine, offline - its server, its JSON records and
  the client side that finds it.
---

# The labml app

labml's app on this machine, without a network: [the server](server.html), its
JSON records and the client side that finds it. `python -m labml_zero.app`
starts the server.
"""
