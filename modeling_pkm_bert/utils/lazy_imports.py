"""One way to import lazily, for every package of modeling_pkm_bert (standard library only).

A package's `__init__` names its public names in a table, module -> names; each name is imported from its module on
first use and then kept in the package, so `import modeling_pkm_bert.x` imports nothing heavy and a script's `--help`
loads no torch:

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {".report": ("write_memory_report", ...), ...})

Module paths are relative to the package the table is in (`.report`, `..methods.optimizers.memory_optimizer`).
"""

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


ModuleTable = Mapping[str, Sequence[str]]


def _module_of(table: ModuleTable) -> dict[str, str]:
    """{module: (names...)} -> {name: module}; a name listed under two modules is a mistake in the table."""
    module_of = {}
    for module, names in table.items():
        if isinstance(names, str):
            raise TypeError(f"the names of {module!r} must be a tuple of names, not the string {names!r}")
        for name in names:
            if name in module_of:
                raise ValueError(f"{name!r} is listed under both {module_of[name]!r} and {module!r}")
            module_of[name] = module
    return module_of


def lazy_exports(
    module_name: str, table: ModuleTable
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """`(__getattr__, __dir__, __all__)` of a package whose public names (`table`: module -> names) resolve on first
    use, each from its one module, and are then kept in the package."""
    module_of = _module_of(table)

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        # relative to the package itself (the table is in its `__init__`)
        value = getattr(importlib.import_module(module_of[name], sys.modules[module_name].__package__), name)
        setattr(sys.modules[module_name], name, value)  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)


__all__ = ["lazy_exports"]
