r"""
---
title: The model families
summary: The registry of model families, one line each, and the two questions
  the job asks of it, by a config.json's model_type and by a preset's name.
---

# The model families

Each family is one package and one line of `FAMILIES`; the job asks this page
for the [family](family.html) of a snapshot (its `config.json`'s
`model_type`) or of a `--model` preset, and then asks the family. A preset's
name and a `model_type` each belong to one family:
no two families share one (tests/test_families.py checks the registry).

## Limitations

* The registry imports every family's package: importing it costs both
  models' modules (torch only, no weights).
"""

from __future__ import annotations

from labml_zero.family import ModelFamily
from labml_zero.llama.family import LLAMA
from labml_zero.neox.family import NEOX

__all__ = ["FAMILIES", "family_for_model_type", "family_for_preset",
           "family_for_config", "model_types", "UnknownFamily"]

# The one line a family adds; the first is the job's default.
FAMILIES: tuple[ModelFamily, ...] = (NEOX, LLAMA)


class UnknownFamily(ValueError):
    """A `model_type` or preset no family has; the message is one line."""


def model_types() -> tuple[str, ...]:
    """Every `model_type` some family reads, in registry order."""
    return tuple(t for family in FAMILIES for t in family.model_types)


def family_for_model_type(model_type: str) -> ModelFamily:
    """The family that reads `config.json`s of this `model_type`."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnknownFamily(f"config.json: no model family reads model_type "
                        f"{model_type!r}; they read {', '.join(model_types())}")


def family_for_preset(name: str) -> ModelFamily:
    """The family with a preset called `name` (`--model`)."""
    for family in FAMILIES:
        if name in family.presets:
            return family
    known = [p for family in FAMILIES for p in family.presets]
    raise UnknownFamily(f"unknown model preset {name!r}; expected one of "
                        f"{', '.join(known)}")


def family_for_config(config) -> ModelFamily:
    """The family whose configs are of `config`'s class."""
    for family in FAMILIES:
        if isinstance(config, family.config_type):
            return family
    raise UnknownFamily(f"no model family has configs of type "
                        f"{type(config).__name__}")
