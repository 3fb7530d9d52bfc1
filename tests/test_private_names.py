"""A module's private names (a leading underscore) stay in it: no module of the project imports another one's
private name (`from eval.engine.decode import _Verify`) or reaches it through the module (`cost._plan(...)`), and no
module imports a third-party package's private internals (`hydra._internal`). What another module needs is public,
with a docstring. Tests may reach inside what they test; they are not walked.
"""

from __future__ import annotations

import ast

from helpers import ROOT

FOLDERS = ("eval", "train", "models", "data", "runtime", "serve", "scripts")
SOURCES = sorted({p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")} | {ROOT / "train.py"})


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """Each private name `source` takes from another module: `from m import _x`, `import m._x`, `from m._x import y`,
    and `m._x` where `m` is a name bound by an import."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to an imported module (or to anything imported: a module or not)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if any(private(part) for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(private(part) for part in alias.name.split(".")):
                    found.append(f"line {node.lineno}: import {alias.name}")
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0].removeprefix("line ")))


def test_no_module_takes_another_ones_private_names():
    bad = {str(p.relative_to(ROOT)): uses for p in SOURCES if (uses := private_uses(p.read_text()))}
    assert not bad, bad


def test_the_walk_finds_each_kind_of_private_use():
    source = """
from eval.engine.decode import _Verify, greedy_decode
from hydra._internal.utils import locate
import torch._dynamo
from eval import cost
cost._plan(1)
greedy_decode._cache
self._own = 1
"""
    assert private_uses(source) == ["line 2: from eval.engine.decode import _Verify",
                                    "line 3: from hydra._internal.utils import ...",
                                    "line 4: import torch._dynamo",
                                    "line 6: cost._plan", "line 7: greedy_decode._cache"]
    assert private_uses("from eval.engine.decode import VerifierSession\nself._own = 1\n") == []
