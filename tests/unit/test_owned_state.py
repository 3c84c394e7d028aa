"""Every class reads through `self` only state that it or its bases set (issue 28, item 6).

A class cut across files as mixins over a shared attribute bag reads attributes that another
class sets: the part cannot be read, tested or changed alone, and a declaration module that
names those attributes for every part hides the import cycle between them. This test walks the
AST of every class in kvdata/ and daemon/ and fails listing `Class.attr (file:line)` for every
`self.attr` a method reads that neither the class nor one of its bases sets.

What sets an attribute, in the class or in one of its bases (resolved by name across the
project's modules, through their imports):
- `self.x = ...`, `self.x: T = ...`, `self.x += ...`, `self.x, self.y = ...`, `for self.x in`,
  `with ... as self.x`, `setattr(self, "x", ...)`, `object.__setattr__(self, "x", ...)`, in any
  method (or a function nested in one);
- the class body: assignments, methods, properties, nested classes, `__slots__`;
- the class body's bare annotations (`x: int`) only where a generated `__init__` or the type
  itself gives them a value: dataclasses, NamedTuple, TypedDict, Protocol. Anywhere else a bare
  annotation only declares what someone else is expected to set -- the forward declaration this
  test exists to catch;
- an external base on EXTERNAL_BASES: what `dir()` of it shows. Any other external base (torch,
  click, watchdog types, or a base this test cannot resolve) is taken to provide anything.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvdata": "kvdata", "daemon": "kvdata_daemon"}  # directory -> the name it is imported by

# External bases whose attributes are known: dir() of the class (imported here; all stdlib).
EXTERNAL_BASES = {
    "builtins.object", "builtins.BaseException", "builtins.Exception", "builtins.ValueError",
    "builtins.RuntimeError", "builtins.OSError", "builtins.KeyError", "builtins.TypeError",
    "builtins.UserWarning", "builtins.str", "builtins.int", "builtins.tuple", "builtins.list", "builtins.dict",
    "threading.Thread", "abc.ABC", "enum.Enum", "enum.IntEnum", "enum.Flag", "enum.IntFlag",
    "typing.Generic", "typing.Protocol", "typing.NamedTuple", "typing.TypedDict",
}
_AS_GIVEN = {"typing.NamedTuple": tuple, "typing.TypedDict": dict, "typing.Generic": object, "typing.Protocol": object}
_NAMEDTUPLE = {"_fields", "_field_defaults", "_make", "_asdict", "_replace"}
_ANNOTATED_FIELDS = {"typing.NamedTuple", "typing.TypedDict", "typing.Protocol"}  # bare annotations are fields

# Classes known to read state they do not own (class name -> its file), each being refactored now
# (issue 28). Empty this as they land: test_the_known_list_is_not_stale fails on an entry that
# no longer offends, so the list never hides a new offender under an old name.
KNOWN: dict[str, str] = {}


@dataclass(eq=False)
class ClassInfo:
    name: str
    module: str
    path: str
    node: ast.ClassDef
    bases: list[ast.expr]
    sets: set[str] = field(default_factory=set)
    annotated: set[str] = field(default_factory=set)  # bare class-body annotations
    dataclass: bool = False


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    classes: dict[str, ClassInfo] = field(default_factory=dict)  # every class by name (nested too)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module.Name"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _self_target_names(target: ast.expr, me: str) -> Iterator[str]:
    """The attributes of `me` an assignment target sets (tuples and starred unpacked)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
        yield target.attr
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _self_target_names(t, me)
    elif isinstance(target, ast.Starred):
        yield from _self_target_names(target.value, me)


def _walk_method(node: ast.AST) -> Iterator[ast.AST]:
    """Every node of a method's body, nested functions and lambdas included (their `self` is the
    method's), nested classes excluded (theirs is their own)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            continue
        yield child
        yield from _walk_method(child)


def _methods(cls: ast.ClassDef) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """(method, the name its instance or class goes by): every method but static ones."""
    for item in cls.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in item.decorator_list):
            continue
        args = item.args.posonlyargs + item.args.args
        if args:
            yield item, args[0].arg


def _sets_in_method(fn: ast.AST, me: str) -> Iterator[str]:
    for node in _walk_method(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                yield from _self_target_names(t, me)
        elif isinstance(node, ast.AnnAssign) and node.value is not None or isinstance(node, ast.AugAssign):
            yield from _self_target_names(node.target, me)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield from _self_target_names(node.target, me)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield from _self_target_names(node.optional_vars, me)
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            func, args = node.func, node.args
            is_setattr = isinstance(func, ast.Name) and func.id == "setattr"
            is_object_setattr = isinstance(func, ast.Attribute) and func.attr == "__setattr__"
            if (is_setattr or is_object_setattr) and isinstance(args[0], ast.Name) and args[0].id == me:
                yield str(args[1].value)


def _class_info(node: ast.ClassDef, module: str, path: str) -> ClassInfo:
    info = ClassInfo(node.name, module, path, node, list(node.bases))
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            info.dataclass = True
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.sets.add(item.name)
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        info.sets.add(n.id)
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                for n in ast.walk(item.value):
                    if isinstance(n, ast.Constant) and isinstance(n.value, str):
                        info.sets.add(n.value)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            (info.sets if item.value is not None else info.annotated).add(item.target.id)
    for fn, me in _methods(node):
        info.sets.update(_sets_in_method(fn, me))
    return info


def _load() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for directory in PACKAGES:
        for path in sorted((ROOT / directory).rglob("*.py")):
            name = _module_name(path)
            rel = str(path.relative_to(ROOT))
            mod = Module(name, rel, ast.parse(path.read_text(), rel))
            is_package = path.name == "__init__.py"
            for node in ast.walk(mod.tree):
                if isinstance(node, ast.ClassDef):
                    mod.classes.setdefault(node.name, _class_info(node, name, rel))
                elif isinstance(node, ast.ImportFrom):
                    src = _resolve_relative(name, is_package, node.level, node.module) if node.level else node.module or ""
                    for a in node.names:
                        mod.imports[a.asname or a.name] = f"{src}.{a.name}"
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            mod.imports[a.asname] = a.name
                        else:
                            top = a.name.split(".")[0]
                            mod.imports[top] = top
            modules[name] = mod
    return modules


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Subscript):  # Generic[T], Sampler[int]
        return _dotted(expr.value)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return None if head is None else f"{head}.{expr.attr}"
    return None


class Hierarchy:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self._provided: dict[int, set[str] | None] = {}

    def lookup(self, qualified: str, depth: int = 0) -> ClassInfo | str | None:
        """A project class by its dotted name (re-exports followed), else the external name."""
        module, _, name = qualified.rpartition(".")
        mod = self.modules.get(module)
        if mod is None:
            return qualified if module.split(".")[0] not in PACKAGES.values() else None
        if name in mod.classes:
            return mod.classes[name]
        if name in mod.imports and depth < 10:
            return self.lookup(mod.imports[name], depth + 1)
        return None

    def resolve_base(self, cls: ClassInfo, expr: ast.expr) -> ClassInfo | str | None:
        """A base as a project class, an external dotted name, or None (not resolvable)."""
        dotted = _dotted(expr)
        if dotted is None:
            return None
        mod = self.modules[cls.module]
        head, _, rest = dotted.partition(".")
        if not rest and head in mod.classes:
            return mod.classes[head]
        if head in mod.imports:
            return self.lookup(mod.imports[head] + (f".{rest}" if rest else ""))
        if not rest and hasattr(builtins, head):
            return f"builtins.{head}"
        return None

    def provided(self, cls: ClassInfo) -> set[str] | None:
        """What the class and its bases set; None: an unknown external base may provide anything."""
        key = id(cls)
        if key in self._provided:
            return self._provided[key]
        self._provided[key] = set()  # (a cycle of bases provides nothing more)
        out: set[str] | None = set(cls.sets) | set(dir(object)) | {"__dict__", "__weakref__"}
        fields_given = cls.dataclass
        for expr in cls.bases:
            base = self.resolve_base(cls, expr)
            if isinstance(base, ClassInfo):
                more = self.provided(base)
                fields_given = fields_given or self._annotated_fields(base)
            elif base in EXTERNAL_BASES:
                more = set(dir(_AS_GIVEN.get(base) or _external(base))) | (_NAMEDTUPLE if base == "typing.NamedTuple" else set())
                fields_given = fields_given or base in _ANNOTATED_FIELDS
            else:
                more = None
            if more is None or out is None:
                out = None
            else:
                out |= more
        if out is not None and fields_given:
            out |= cls.annotated
        self._provided[key] = out
        return out

    def _annotated_fields(self, cls: ClassInfo) -> bool:
        """Whether bare annotations are fields in classes derived from this one (NamedTuple, ...)."""
        for expr in cls.bases:
            base = self.resolve_base(cls, expr)
            if base in _ANNOTATED_FIELDS or (isinstance(base, ClassInfo) and self._annotated_fields(base)):
                return True
        return False


def _external(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    assert isinstance(obj, type), dotted
    return obj


def offenders() -> dict[tuple[str, str], list[str]]:
    """(class name, file) -> `Class.attr (file:line)` for every read of state the class does not own."""
    modules = _load()
    hierarchy = Hierarchy(modules)
    found: dict[tuple[str, str], list[str]] = {}
    for mod in modules.values():
        for cls in mod.classes.values():
            provided = hierarchy.provided(cls)
            if provided is None:
                continue
            for fn, me in _methods(cls.node):
                for node in _walk_method(fn):
                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) \
                            and isinstance(node.value, ast.Name) and node.value.id == me and node.attr not in provided:
                        found.setdefault((cls.name, cls.path), []).append(f"{cls.name}.{node.attr} ({cls.path}:{node.lineno})")
    return found


def test_every_class_reads_only_state_it_or_its_bases_set() -> None:
    found = offenders()
    new = sorted(line for (name, path), lines in found.items() if KNOWN.get(name) != path for line in lines)
    assert not new, ("these classes read through `self` attributes that neither they nor their bases set "
                     "(give each part the state it uses, or pass what it uses in):\n" + "\n".join(new))


def test_the_known_list_is_not_stale() -> None:
    found = offenders()
    stale = sorted(name for name, path in KNOWN.items() if (name, path) not in found)
    assert not stale, f"no longer read state they do not own: remove them from KNOWN in {__file__}: {stale}"


def test_the_check_sees_a_mixin_over_a_declared_bag() -> None:
    """The check itself: a forward declaration is not a set; a dataclass field, a NamedTuple field,
    an attribute set in a base and one set by a tuple assignment are."""
    source = '''
import threading
from dataclasses import dataclass
from typing import NamedTuple

class Bag:
    declared: int

class Part(Bag):
    def use(self) -> int:
        return self.declared + self.other()

class Whole(Part):
    def __init__(self) -> None:
        self.declared = 1
    def other(self) -> int:
        return 2

@dataclass
class Fields:
    a: int
    def twice(self) -> int:
        return 2 * self.a

class Pair(NamedTuple):
    a: int
    def first(self) -> int:
        return self.a + len(self._fields)

class Base:
    def __init__(self) -> None:
        self.x, (self.y, *self.z) = 1, (2, 3)

class Derived(Base, threading.Thread):
    def sum(self) -> int:
        return self.x + self.y + len(self.z) + len(self.name)
'''
    tree = ast.parse(source)
    mod = Module("kvdata.sample", "kvdata/sample.py", tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            mod.classes[node.name] = _class_info(node, mod.name, mod.path)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                mod.imports[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod.imports[a.name] = a.name
    hierarchy = Hierarchy({mod.name: mod})
    missing = {}
    for cls in mod.classes.values():
        provided = hierarchy.provided(cls)
        assert provided is not None, cls.name
        reads = {n.attr for fn, me in _methods(cls.node) for n in _walk_method(fn)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me
                 and isinstance(n.ctx, ast.Load)}
        if reads - provided:
            missing[cls.name] = sorted(reads - provided)
    assert missing == {"Part": ["declared", "other"]}
