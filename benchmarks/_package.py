"""Makes this folder the package `benchmarks` for an entry run by path.

`python benchmarks/<entry>.py` puts this folder first on sys.path, not the repository root, so `import benchmarks`
would fail there; this module (found in that folder) loads the folder's `__init__.py` as the package `benchmarks` into
sys.modules, sys.path untouched, after which the entry's `from benchmarks... import` resolve exactly as they do under
`python -m benchmarks.<entry>` from the repository root. An entry imports it only when it runs without a package:

    if not __package__:  # run by path (python benchmarks/<entry>.py): this folder is the package (see _package.py)
        import _package  # noqa: F401
"""

import importlib.util
import sys
from pathlib import Path


if "benchmarks" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("benchmarks", Path(__file__).with_name("__init__.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["benchmarks"] = _module
    _spec.loader.exec_module(_module)
