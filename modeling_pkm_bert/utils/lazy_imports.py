"""One way to import lazily, for every package of modeling_pkm_bert (standard library only).

A package's `__init__` names its public names in a table, module -> names; each name is imported from its module on
first use and then kept in the package, so `import modeling_pkm_bert.x` imports nothing heavy and a script's `--help`
loads no torch:

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {".report": ("write_memory_report", ...), ...})

A name that moved to another module stays importable from its old place for one release, with a DeprecationWarning
that names the new one (`moved_names`, or `lazy_exports(..., moved=...)` in a package). Module paths are relative to
the package of the module the table is in (`.report`, `..methods.optimizers`).
"""

import importlib
import sys
import warnings
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


def _import(module_name: str, relative: str):
    # the anchor of a relative path: the package itself for an `__init__`, else the module's package
    return importlib.import_module(relative, sys.modules[module_name].__package__)


def _moved(module_name: str, new_module: str, name: str, stacklevel: int):
    module = _import(module_name, new_module)
    warnings.warn(
        f"{module_name}.{name} moved to {module.__name__}.{name}; the old path goes away in the next release",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return getattr(module, name)


def moved_names(module_name: str, moved: ModuleTable) -> Callable[[str], object]:
    """A module-level `__getattr__` for a module that names moved out of: `from <module_name> import X` still gives
    X from its new module, with a DeprecationWarning naming it (at every use: the old path is never cached).

        __getattr__ = moved_names(__name__, {"..methods.optimizers": ("SparseRowAdam", "pkm_param_groups")})
    """
    new_module_of = _module_of(moved)

    def __getattr__(name: str):
        if name not in new_module_of:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _moved(module_name, new_module_of[name], name, stacklevel=2)

    return __getattr__


def lazy_exports(
    module_name: str, table: ModuleTable, moved: ModuleTable | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """`(__getattr__, __dir__, __all__)` of a package whose public names (`table`: module -> names) resolve on first
    use, each from its one module, and are then kept in the package. `moved`: old names of the package, resolved from
    their new module with a DeprecationWarning (`moved_names`), not in `__all__`."""
    module_of, new_module_of = _module_of(table), _module_of(moved or {})

    def __getattr__(name: str):
        if name in new_module_of:
            return _moved(module_name, new_module_of[name], name, stacklevel=2)
        if name not in module_of:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(_import(module_name, module_of[name]), name)
        setattr(sys.modules[module_name], name, value)  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)


__all__ = ["lazy_exports", "moved_names"]
