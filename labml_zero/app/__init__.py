"""
---
title: The labml app
summary: labml-app on this machine, offline - its server, its JSON records and
  the client side that finds it.
---

# The labml app

The fine-tune's runs can be watched in labml's app without a network. This
package is that app, apart from the engine and the job; its pages, in reading
order: [the server](server.html) (labml-app's API and page, with the guard that
refuses bad requests), [the records](records.html) (JSON files instead of
MongoDB) and [the client side](client.html) (where a run looks for the app).
`python -m labml_zero.app` starts the server.
"""
