"""The drafter methods, one folder each: its entry (`METHOD`, a `methods.method.Method`) in the folder's
`__init__.py`, its recipe section in `config.py` (no torch), and the parts the entry names by path: the model, the
evaluation proposer, the export layouts and load gates, the importers of other projects' checkpoints.

    from methods import METHODS, FORMATS
    method = METHODS[recipe.drafter.method]

Adding a method: a folder `methods/<name>/` (its entry, config, model and whatever else it names), its name in
`NAMES` below, its recipes, one test file. Loading this package imports only the entries and their configs: no torch.
"""

from __future__ import annotations

import importlib

from methods.method import EAGLE_TREES, STATIC_TREES, Layout, Method, resolve

NAMES = ("eagle2", "eagle3", "peagle", "medusa1", "medusa2", "dflash")
"""The method folders, in the order listings show them: a new method adds its folder's name here."""

METHODS: dict[str, Method] = {name: importlib.import_module(f"methods.{name}").METHOD for name in NAMES}
"""Every method, by the name recipes give as `drafter.method`."""

FORMATS: tuple[str, ...] = tuple(dict.fromkeys(fmt for method in METHODS.values() for fmt in method.formats))
"""Every export format some method declares, native first: what `export.format` and `python -m export` accept."""

__all__ = ["EAGLE_TREES", "FORMATS", "METHODS", "STATIC_TREES", "Layout", "Method", "resolve"]
