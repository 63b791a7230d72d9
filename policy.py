"""What a strategy may use: the one definition that the static judge (rewards.py) and the sandbox's loader share.

A strategy is plain Python over the board: pure-computation stdlib modules, ordinary builtins, ordinary
attributes. `violations(tree)` lists everything else the code reaches for, read from the syntax tree alone:
rewards.py scores an answer with a violation as cheating and never plays it, and the sandbox refuses to load
one, so the two can never disagree. It judges names *in use* (imports, attribute accesses, builtins that the
code calls without defining them itself), not every identifier: a local variable called `input`, `code` or
`signal` is honest. Strings are not judged; the loader's runtime checks (getattr and friends) cover a name
built at run time.

This layer fails fast and says why; it is not the boundary. The sandbox assumes that any code can break out
of Python and keeps the machine safe with OS-level walls (see docs/SECURITY.md).
"""

from __future__ import annotations

import ast
import builtins

# Pure-computation stdlib modules. `time` is in: clocks and sleep reach nothing outside the process, and
# "search until the move budget is spent" is an ordinary expectimax idea. Left out: anything that reaches
# the OS, the interpreter or other objects (os, sys, io, gc, inspect, types, importlib, ctypes, pickle, ...).
ALLOWED_MODULES = frozenset(
    {
        "__future__", "array", "bisect", "cmath", "collections", "collections.abc", "copy", "dataclasses",
        "decimal", "enum", "fractions", "functools", "heapq", "itertools", "math", "numbers", "operator",
        "random", "re", "statistics", "string", "time", "typing",
    }
)  # fmt: skip

# Builtins a strategy may call; the sandbox gives it these and no others. getattr & co. are there, wrapped by
# the sandbox so that a name computed at run time is checked like a written one.
ALLOWED_BUILTINS = frozenset(
    {
        "abs", "aiter", "all", "anext", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr",
        "classmethod", "complex", "delattr", "dict", "dir", "divmod", "enumerate", "filter", "float", "format",
        "frozenset", "getattr", "hasattr", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len",
        "list", "map", "max", "min", "next", "object", "oct", "ord", "pow", "print", "property", "range", "repr",
        "reversed", "round", "set", "setattr", "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple",
        "type", "zip", "Ellipsis", "NotImplemented",
    }
    | {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
)  # fmt: skip

# Dunder names a strategy may use: what ordinary classes need. Every other name that starts with "__" is refused
# (__class__, __subclasses__, __globals__, __dict__, __code__, __self__, __builtins__, __match_args__, ...).
SAFE_DUNDERS = frozenset(
    {
        "__init__", "__post_init__", "__name__", "__qualname__", "__doc__", "__slots__", "__len__", "__iter__",
        "__next__", "__contains__", "__getitem__", "__setitem__", "__delitem__", "__eq__", "__ne__", "__lt__",
        "__le__", "__gt__", "__ge__", "__hash__", "__repr__", "__str__", "__bool__", "__main__",
    }
)  # fmt: skip
# Frame, traceback, generator and code attributes: each is a walk to some other frame's globals.
INTROSPECTION_ATTRIBUTES = frozenset(
    {
        "f_back", "f_builtins", "f_code", "f_globals", "f_locals", "f_trace", "f_lineno", "tb_frame", "tb_next",
        "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "cr_origin", "ag_frame",
        "ag_code", "ag_await", "co_code", "co_consts", "co_names",
    }
)  # fmt: skip
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})
_ALL_BUILTINS = frozenset(dir(builtins))


def module_allowed(name: str) -> bool:
    return name in ALLOWED_MODULES


def attribute_allowed(name: str) -> bool:
    """An attribute name a strategy may read or write: no dunder outside SAFE_DUNDERS, no introspection."""
    return name not in INTROSPECTION_ATTRIBUTES and (not name.startswith("__") or name in SAFE_DUNDERS)


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere: assignments, parameters, defs, imports, handlers, patterns."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.partition(".")[0])
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            bound.update(node.names)
    return bound


def violations(tree: ast.AST) -> list[str]:
    """What the code uses that a strategy may not, each said once, in the order found; [] when clean.

    Linear in the size of the tree: two walks.
    """
    bound = _bound_names(tree)
    found: dict[str, None] = {}

    def refuse(what: str) -> None:
        found.setdefault(what)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not module_allowed(alias.name):
                    refuse(f"import of {alias.name!r}")
        elif isinstance(node, ast.ImportFrom):
            if node.level or not module_allowed(node.module or ""):
                refuse(f"import from {'.' * node.level}{node.module or ''}")
        elif isinstance(node, ast.Name):
            if node.id.startswith("__") and node.id not in SAFE_DUNDERS:
                refuse(f"name {node.id!r}")
            elif isinstance(node.ctx, ast.Load) and node.id not in bound and node.id in _ALL_BUILTINS:
                if node.id not in ALLOWED_BUILTINS:
                    refuse(f"builtin {node.id!r}")
        elif isinstance(node, ast.Attribute):
            if not attribute_allowed(node.attr):
                refuse(f"attribute {node.attr!r}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name.startswith("__") and node.name not in SAFE_DUNDERS:
                refuse(f"definition of {node.name!r}")
        elif isinstance(node, ast.keyword):
            if node.arg and not attribute_allowed(node.arg):
                refuse(f"keyword {node.arg!r}")
        elif isinstance(node, ast.MatchClass):
            # A class pattern reads attributes: named ones are written out, positional ones come from the class's
            # __match_args__, which could name anything. Only builtin types (int(x), str(s)) match positionally.
            for attr in node.kwd_attrs:
                if not attribute_allowed(attr):
                    refuse(f"pattern attribute {attr!r}")
            builtin_type = isinstance(node.cls, ast.Name) and node.cls.id in ALLOWED_BUILTINS and node.cls.id not in bound
            if node.patterns and not builtin_type:
                refuse("positional class pattern")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            if node.func.id not in bound:
                name = node.args[1] if len(node.args) > 1 else None
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    refuse(f"{node.func.id} with a computed name")
                elif not attribute_allowed(name.value):
                    refuse(f"attribute {name.value!r}")
    return list(found)
