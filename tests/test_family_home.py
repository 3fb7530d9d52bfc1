"""A family has one home (the design note "A family's home"): what differs between drafter families
lives in the family's own modules and is reached through its registry entry (models/families.py) or a method a
contract declares (eval/engine/protocol.py, train/base.py). Shared code never branches on which family it holds.

This walks the source of the shared modules and fails on
  (a) a comparison (==, !=, is, in, not in, or a match-case pattern) with a string literal that names a registered
      family (a key of FAMILIES, or "eagle1");
  (b) an isinstance / issubclass / `type(x) is` (or ==) check against a class a family's own module defines (its
      network, training module or drafter), and any check of a class's name (`__name__`, `__class__.__name__`).
"""

from __future__ import annotations

import ast
import importlib
import inspect

from helpers import ROOT
from models.families import FAMILIES, resolve

FAMILY_NAMES = frozenset(FAMILIES) | {"eagle1"}

# Each family's own modules, as the registry reaches them (models.families.Family.modules): they may name their
# family and their classes. Every other module of eval/ (its subpackages too), train/, models/, data/, runtime/ and
# serve/ is shared and checked, and train.py; models/families.py is the registry, where families are named.
FAMILY_FILES = frozenset(ROOT / (m.replace(".", "/") + ".py") for f in FAMILIES.values() for m in f.modules)
REGISTRY = ROOT / "models" / "families.py"
SHARED = sorted(
    {p for folder in ("eval", "train", "models", "data", "runtime", "serve") for p in (ROOT / folder).rglob("*.py")
     if p not in FAMILY_FILES and p != REGISTRY}
    | {ROOT / "train.py"}
)

# Branches on a family still in shared code, file -> how many, each being moved into its family right now by the
# engineer who owns that file. A count may only go down: a new branch anywhere fails, and so does a count left
# higher than what the file still holds (lower it; delete the entry at 0). Empty this list, do not grow it.
PENDING = {
}


def _family_classes() -> frozenset[str]:
    """The names of every class a family's own module defines (networks, training modules, drafters), and of the
    unions of them it names (`EagleNet = Eagle1Net | Eagle3Net`)."""
    names = {f.network.__name__ for f in FAMILIES.values() if f.network is not None}
    for path in FAMILY_FILES:
        tree = ast.parse(path.read_text())
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        names |= {n.targets[0].id for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                  and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.BinOp)
                  and isinstance(n.value.op, ast.BitOr)}
    return frozenset(names)


FAMILY_CLASSES = _family_classes()


def _strings(node: ast.AST) -> list[str]:
    """The string literals `node` is, or holds as a tuple / list / set / frozenset(...) display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set",
                                                                                           "tuple") and node.args:
        return _strings(node.args[0])
    return []


def _class_names(node: ast.AST) -> list[str]:
    """The class names an isinstance second argument (or a `type(x) is` side) refers to: `Name`, `mod.Name`, and
    tuples of them."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _class_names(e)]
    return []


def _names_a_class(node: ast.AST) -> bool:
    """`x.__name__`, `x.__class__.__name__`, `type(x).__name__`, `__qualname__`."""
    return isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")


def _is_type_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def branches(source: str) -> list[tuple[int, str]]:
    """(line, what) for every per-family branch in `source` (the module docstring's rules (a) and (b))."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = sorted({s for side in sides for s in _strings(side)} & FAMILY_NAMES)
            if named:
                found.append((node.lineno, f"compares with the family name(s) {named}"))
            if any(_names_a_class(s) for s in sides) and any(_strings(s) for s in sides):
                found.append((node.lineno, "compares a class's name with a string"))
            if any(_is_type_call(s) for s in sides):
                classes = sorted({c for s in sides if not _is_type_call(s) for c in _class_names(s)} & FAMILY_CLASSES)
                if classes:
                    found.append((node.lineno, f"compares type(...) with the family class(es) {classes}"))
        elif isinstance(node, ast.match_case):
            named = sorted({s for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)
                            for s in _strings(p.value)} & FAMILY_NAMES)
            classes = sorted({c for p in ast.walk(node.pattern) if isinstance(p, ast.MatchClass)
                              for c in _class_names(p.cls)} & FAMILY_CLASSES)
            if named:
                found.append((node.pattern.lineno, f"matches the family name(s) {named}"))
            if classes:
                found.append((node.pattern.lineno, f"matches the family class(es) {classes}"))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                classes = sorted(set(_class_names(node.args[1])) & FAMILY_CLASSES)
                if classes:
                    found.append((node.lineno, f"{func.id} against the family class(es) {classes}"))
            if (isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith")
                    and _names_a_class(func.value)):
                found.append((node.lineno, f"checks a class's name with {func.attr}"))
    return sorted(set(found))


def _scan() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in SHARED:
        if path.is_file():
            hits = branches(path.read_text())
            if hits:
                out[str(path.relative_to(ROOT))] = hits
    return out


def test_shared_code_never_branches_on_a_family():
    found = _scan()
    news = {f: hits for f, hits in found.items() if len(hits) > PENDING.get(f, 0)}
    assert not news, ("Shared code branches on a drafter family; move the decision into the family's own module and "
                      "reach it through its registry entry (models/families.py) or a declared method "
                      "(eval/engine/protocol.py, train/base.py):\n"
                      + "\n".join(f"  {f}:{line}: {what}" for f, hits in news.items() for line, what in hits))
    stale = {f: (n, len(found.get(f, []))) for f, n in PENDING.items() if len(found.get(f, [])) < n}
    assert not stale, ("PENDING allows more branches than these files still hold; lower the counts (delete an entry "
                       "at 0): " + ", ".join(f"{f}: {n} -> {left}" for f, (n, left) in stale.items()))


def test_the_walk_sees_every_kind_of_branch():
    """A negative control: each rule fires on a line that breaks it, and leaves its lawful neighbours alone."""
    bad = [
        'if kind == "medusa": pass',
        'if "eagle3" != cfg.kind: pass',
        'ok = name in ("eagle", "eagle1")',
        'ok = kind not in {"dflash"}',
        'match kind:\n    case "peagle": pass',
        "ok = isinstance(net, MedusaHeads)",
        "ok = isinstance(d, (eval.drafters.eagle.EagleDrafter, int))",
        "ok = issubclass(cls, MedusaModule)",
        "ok = type(net) is Eagle3Net",
        'ok = module.__class__.__name__.startswith("Medusa")',
        'ok = type(net).__name__ == "PEagleNet"',
    ]
    for line in bad:
        assert branches(line), line
    good = [
        'if kind == "chain": pass',
        "ok = isinstance(policy, AutoTree)",
        "ok = FAMILIES[kind].tree == 'fixed'",
        "ok = type(net) is fam.network",
        'print(f"{type(x).__name__} is no drafter")',
    ]
    for line in good:
        assert not branches(line), line


def test_the_walk_covers_the_shared_modules():
    names = {str(p.relative_to(ROOT)) for p in SHARED}
    assert {"eval/planner/cost.py", "eval/offline.py", "eval/harness.py", "eval/drafters/build.py",
            "eval/engine/decode.py", "train/base.py", "train/memory.py", "train/export.py",
            "models/exports/io.py", "models/exports/speculators.py", "data/chat.py", "train.py"} <= names
    assert set(PENDING) <= names
    assert not names & {str(p.relative_to(ROOT)) for p in FAMILY_FILES}
    assert all(p.is_file() for p in FAMILY_FILES), sorted(str(p) for p in FAMILY_FILES if not p.is_file())
    # every family's modules in every layer its entry names: a family module missed here would be checked as shared
    assert {"eval/drafters/dspark.py", "train/dspark.py", "models/dspark.py", "models/formats/dspark.py",
            "eval/drafters/lookup.py"} <= {str(p.relative_to(ROOT)) for p in FAMILY_FILES}


def test_every_family_keeps_the_declared_contracts():
    """What shared code calls instead of branching: every training module implements DrafterModule's abstract
    members (train.py, train/export.py, train/memory.py), every drafter class of a family's eval/ module answers the
    planner (eval.engine.protocol.CostProbe: eval.planner.cost.draft_cost), and every export family names its
    teacher-forced
    scoring (eval/offline.py)."""
    from eval.engine.protocol import CostProbe

    for name, fam in FAMILIES.items():
        if fam.training is not None:
            module = resolve(fam.training)
            assert not inspect.isabstract(module), (name, sorted(module.__abstractmethods__))
        if fam.has_export:
            assert fam.teacher_forced is not None and callable(resolve(fam.teacher_forced)), name
    decoders = {m for f in FAMILIES.values() for m in f.modules if m.startswith("eval.drafters.")}
    for name in sorted(decoders):
        mod = importlib.import_module(name)
        drafters = [c for _, c in inspect.getmembers(mod, inspect.isclass)
                    if c.__module__ == mod.__name__ and callable(getattr(c, "propose", None))]
        assert drafters, name
        for cls in drafters:
            assert issubclass(cls, CostProbe), (f"{cls.__qualname__} declares no draft_cost "
                                                f"(eval.engine.protocol.CostProbe)")
