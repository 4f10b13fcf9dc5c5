"""Packages that load their contents on first use (PEP 562).

A package's `__init__` names what it exports and the submodule each comes
from; nothing is imported until a name is asked for, so that importing one
submodule (an `errors` module, say) does not load the rest of its package.
Below every layer: it imports nothing of the project.
"""

from __future__ import annotations

import importlib
import sys


def exports(package: str, homes: dict[str, str]):
    """(__getattr__, __dir__) for the package named `package`, whose exported
    names `homes` maps to the submodule that defines each ("log" for
    `package.log`); any other name is tried as a submodule.  A value is
    looked up once and kept on the package (so export classes and functions,
    never a module's mutable state)."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:  # a submodule not imported yet (`package.format`), or nothing
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__


def homes_of(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{name: submodule} from {submodule: (names...)}."""
    return {name: module for module, names in table.items() for name in names}
