"""The house rules that keep the architecture visible: core never imports a plugin, core's packages
import downward only, and the project's docs stand on their own."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core"

# Core's layers, lowest first: a module may import its own layer and the ones before it. (Imports
# inside functions count too: a lazy import is still a dependency.)
LAYERS = [
    {"version", "envs", "private_store", "program", "json_schema_support", "sampling_params", "outputs",
     "logits_processor", "tokenizer", "accelerator", "config"},
    {"parallel"},
    {"models", "features"},
    {"testing", "engine", "hookspecs", "plugins"},
    {"llm", "offline_chat", "server", "__init__"},
    {"eval"},
    {"cli", "entrypoints", "benchmarks"},
]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _core_modules(core: Path = CORE):
    return sorted(p for p in core.rglob("*.py"))


def test_core_never_imports_a_plugin():
    offenders = [(str(p.relative_to(REPO)), name) for p in _core_modules() for name in _imports(p)
                 if name == "deepinfer_plugins" or name.startswith("deepinfer_plugins.")]
    assert not offenders, f"core imports plugins: {offenders}"


def _layer_of(top: str) -> int:
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"core/{top} is in no layer of tests/test_layering.py: add it where it belongs")


def _upward_imports(core: Path) -> list[str]:
    """Imports of a higher layer by the modules under `core` (a checkout's core/ folder)."""
    upward = []
    for path in _core_modules(core):
        own = path.relative_to(core).parts[0].removesuffix(".py")
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "deepinfer" or len(parts) < 2:
                continue
            if _layer_of(parts[1]) > _layer_of(own):
                upward.append(f"{path.relative_to(core.parent)} imports deepinfer.{parts[1]}")
    return upward


def test_core_packages_import_downward_only():
    # where the layers meet on purpose: the builder loads plugins; envs asks the installed feature
    # plugins which variables they declare (a lazy import, so envs stays importable first)
    allowed = {"core/engine/builder.py imports deepinfer.plugins", "core/envs.py imports deepinfer.plugins"}
    assert sorted(set(_upward_imports(CORE)) - allowed) == []


def test_the_layer_check_can_fail(tmp_path):
    bad = tmp_path / "core" / "models" / "_layering_probe.py"  # a copy of core/ holding one violation
    bad.parent.mkdir(parents=True)
    bad.write_text("from deepinfer.engine import scheduler\n")
    (tmp_path / "core" / "engine.py").write_text("from deepinfer.models import registry\n")  # downward: fine
    assert _upward_imports(tmp_path / "core") == ["core/models/_layering_probe.py imports deepinfer.engine"]


# Code that edits the import path: a module reached that way is hidden from readers and tools, and
# an import then depends on what ran before. Examples import their own helpers by bare name (their
# folder is first on sys.path when they run); tests load examples by path (tests/example_modules.py).
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(?:\.\s*(?:insert|append|extend)\s*\(|\[[^\]]*\]\s*=|\+=)")


def _sys_path_edits(paths) -> list[str]:
    return [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in paths
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if SYS_PATH_EDIT.search(line)]


def test_no_code_edits_the_import_path():
    paths = sorted(path for root in ("core", "plugins", "examples", "scripts", "tests")
                   for path in (REPO / root).rglob("*.py"))
    hits = _sys_path_edits(paths)
    assert not hits, "\n".join(hits)


def test_the_import_path_check_can_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    probe = tmp_path / "probe.py"
    path = "sys" + ".path"  # spelled apart, or this file would be a hit itself
    probe.write_text(f"import sys\n{path}.insert(0, 'examples')\n{path}[:0] = ['x']\n{path}.append('y')\n"
                     f"{path} += ['z']\nprint({path}[0])\n")
    assert [hit.split(":")[1] for hit in _sys_path_edits([probe])] == ["2", "3", "4", "5"]


EXTERNAL_DOC = re.compile(r"shared/|\b(?:deepseek-v4|deepseek-v41|anchors|machine|llamacpp-anchor|architecture)\.md\s*§")
EXTERNAL_NAME = re.compile(r"\b(?:deepseek-v4|deepseek-v41|anchors|machine)\.md\b")
# in source a bare section sign cites the external notes too (the project's docs have no numbered
# sections): `§` is fine only after a docs/<name>.md
OWN_SECTION = re.compile(r"docs/[\w.-]+\.md\s*§")


def _external_citations(path: Path, source: bool = False, repo: Path = REPO) -> list[str]:
    return [f"{path.relative_to(repo)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if EXTERNAL_DOC.search(line) or EXTERNAL_NAME.search(line)
            or (source and "§" in line and not OWN_SECTION.search(line))]


def _source_citations(repo: Path) -> list[str]:
    """External citations in the modules, docstrings and comments under a checkout's core/ and plugins/."""
    return [hit for root in ("core", "plugins") for path in sorted((repo / root).rglob("*.py"))
            for hit in _external_citations(path, source=True, repo=repo)]


@pytest.mark.parametrize("path", sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")]), ids=lambda p: p.name)
def test_docs_stand_on_their_own(path):
    """No project doc cites reference material that is not in the repository."""
    hits = _external_citations(path)
    assert not hits, hits


def test_source_docstrings_stand_on_their_own():
    """No module, docstring or comment under core/ and plugins/ cites reference notes that are not
    in the repository: each states the fact, or points to the project's own docs."""
    hits = _source_citations(REPO)
    assert not hits, "\n".join(hits)


def test_the_citation_check_can_fail(tmp_path):
    bad = tmp_path / "core" / "models" / "_citation_probe.py"  # a copy of core/ holding one citation
    bad.parent.mkdir(parents=True)
    bad.write_text('"""Pooling (deepseek-v4.md §8.2), see also §4 and shared/notes."""\n# docs/model.md § is fine\n')
    assert _source_citations(tmp_path) == [
        'core/models/_citation_probe.py:1: """Pooling (deepseek-v4.md §8.2), see also §4 and shared/notes."""']


# ----- plugins use core's public names only ---------------------------------------------------------------

#: private attributes of third-party objects that plugins may read (not core's): torch.Tensor's version counter
THIRD_PARTY_PRIVATE = {"_version"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_definitions(root: Path) -> set[str]:
    """Every private name defined under `root`: functions, classes, variables, and attributes assigned."""
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for x in ast.walk(target):
                        if isinstance(x, ast.Name) and _private(x.id):
                            names.add(x.id)
                        elif isinstance(x, ast.Attribute) and _private(x.attr):
                            names.add(x.attr)
    return names


def private_uses(plugin_root: Path, core_private: set[str]) -> list[str]:
    """Where plugin code under `plugin_root` imports a private name or module of core, or reads an attribute
    whose name is private to core (defined in core and nowhere in the plugins: a plugin's own private names
    are its business)."""
    own = _private_definitions(plugin_root) | THIRD_PARTY_PRIVATE
    hits = []
    for path in sorted(plugin_root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deepinfer":
                for alias in node.names:
                    if _private(alias.name) or any(_private(part) for part in node.module.split(".")):
                        hits.append(f"{path.relative_to(plugin_root.parent)}:{node.lineno} imports "
                                    f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "deepinfer" and any(_private(p) for p in alias.name.split(".")):
                        hits.append(f"{path.relative_to(plugin_root.parent)}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in core_private \
                    and node.attr not in own:
                hits.append(f"{path.relative_to(plugin_root.parent)}:{node.lineno} uses core's private {node.attr}")
    return hits


def test_no_plugin_uses_a_private_name_of_core():
    """Plugins (the in-tree back ends and features alike) reach core through its public names only."""
    assert private_uses(REPO / "plugins", _private_definitions(CORE)) == []


def test_the_private_name_scan_can_fail(tmp_path):
    plugin = tmp_path / "plugins" / "acme"
    plugin.mkdir(parents=True)
    (plugin / "kernels.py").write_text(
        "from deepinfer.models.deepseek_v4.attention import _secret\n"
        "import deepinfer.models._hidden\n"
        "def f(attn, w):\n    own = attn._own_cache\n    return attn._window_flat(w), w._version\n"
        "class K:\n    def __init__(self):\n        self._own_cache = {}\n")
    hits = private_uses(tmp_path / "plugins", {"_window_flat", "_own_cache"})
    assert hits == ["plugins/acme/kernels.py:1 imports deepinfer.models.deepseek_v4.attention._secret",
                    "plugins/acme/kernels.py:2 imports deepinfer.models._hidden",
                    "plugins/acme/kernels.py:5 uses core's private _window_flat"]
