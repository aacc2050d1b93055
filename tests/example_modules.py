"""The examples and scripts as modules, imported by their path: they are programs, not a package, and
tests import them without putting their folders on `sys.path`.

An example imports the examples' own helpers (`examples/_launch.py`, `_speculation.py`, ...) by
their bare names, as it does when run as a script (its folder is then first on `sys.path`); so
`load_example` imports those helpers first, by path, under those names."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = REPO / "scripts"


def load_file(path: Path, name: str) -> ModuleType:
    """The module of the Python file `path`, imported once under `name` (later calls return it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_example(relative: str) -> ModuleType:
    """`examples/<relative>` (e.g. "benchmark.py", "sweep/plot_pareto.py", "_structured_output.py"):
    a helper (`_*.py`) under its bare name, which is how the examples import it, an example under
    `example_<name>`."""
    for helper in sorted(EXAMPLES.glob("_*.py")):
        load_file(helper, helper.stem)
    path = EXAMPLES / relative
    return load_file(path, path.stem if path.stem.startswith("_") else f"example_{path.stem}")


def load_script(name: str) -> ModuleType:
    """`scripts/<name>.py` under `script_<name>`."""
    return load_file(SCRIPTS / f"{name}.py", f"script_{name}")
