"""What a strategy may use: the one contract that the prompt states (prompt_rules), the static judge enforces (judge)
and the sandbox's child serves.

A strategy is a module that defines `strategy(board)` in plain Python: the standard-library modules in MODULES, each
with every public name (sys only for its constants, getsizeof and recursion limit), the builtins in ALLOWED_BUILTINS,
its own classes with ordinary special methods, no introspection, and nothing outside its own process.

This layer teaches; it is not the boundary. The kernel is: the sandbox's child runs behind a seccomp allowlist that
kills it on any system call outside it, and the referee scores that death as cheating (sandbox_child.py,
docs/SECURITY.md). So the judge looks for the plain forms the prompt names (`import os`, `eval(...)`, `open(...)`,
`sys._getframe`, `random._inst`, `x.__subclasses__`) in the syntax tree, and nothing cleverer: a way round it that
stays inside the child's process reads only that process, which holds no part of the game, and any step outside is
seen by the kernel. `judge(code)` says, for source text:

- violations: what the code uses that the contract forbids (scored as cheating, never played);
- structure: why it is not a module the sandbox plays (no `def strategy(board)`, statements other than definitions at
  the top level): not played, not cheating.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import sys
import types

# The standard-library modules a strategy may import: pure computation. The sandbox serves each as a copy that holds
# every public name of it (public_names), other modules among them only when they are allowed too (so not
# contextlib.os or enum.bltns, which is builtins), and for sys only SYS_NAMES.
MODULES = frozenset({
    "__future__", "abc", "array", "bisect", "cmath", "collections", "collections.abc", "contextlib", "copy",
    "dataclasses", "decimal", "enum", "fractions", "functools", "heapq", "itertools", "math", "numbers", "operator",
    "random", "re", "statistics", "string", "sys", "time", "typing",
})  # fmt: skip
# sys's constants (values that are plain data: maxsize, float_info, byteorder, version_info, ...), and three functions.
SYS_NAMES = frozenset(
    {n for n, v in vars(sys).items() if not n.startswith("_")
     and isinstance(v, bool | int | float | complex | str | bytes | tuple | frozenset | types.NoneType)}
    | {"getsizeof", "getrecursionlimit", "setrecursionlimit"}
)  # fmt: skip

# Builtins a strategy may call; the sandbox gives it these and no others. (locals() reaches only the code's own names:
# at the top level, its module's, where its only statements are definitions.)
ALLOWED_BUILTINS = frozenset(
    {
        "abs", "aiter", "all", "anext", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr",
        "classmethod", "complex", "delattr", "dict", "dir", "divmod", "enumerate", "filter", "float", "format",
        "frozenset", "getattr", "hasattr", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len",
        "list", "locals", "map", "max", "memoryview", "min", "next", "object", "oct", "ord", "pow", "print",
        "property", "range", "repr", "reversed", "round", "set", "setattr", "slice", "sorted", "staticmethod", "str",
        "sum", "super", "tuple", "type", "zip", "Ellipsis", "NotImplemented",
    }
    | {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
)  # fmt: skip
_FORBIDDEN_BUILTINS = frozenset(dir(builtins)) - ALLOWED_BUILTINS

# Double-underscore names a strategy may define, read and call: the special methods, that is every method Python's
# data model (the language reference's `object.__x__`: operators, protocols, ordinary classes) or a protocol of an
# allowed module calls on a strategy's own objects: copy's (__copy__, __deepcopy__, 3.13's __replace__) with the pickle
# methods it falls back on (__reduce_ex__, __reduce__, __getnewargs_ex__, __getnewargs__, __getstate__, __setstate__),
# abc's (__subclasshook__, __isabstractmethod__), dataclasses' __post_init__, os.PathLike's __fspath__; and a few names.
# Defining one reaches nothing a strategy could not reach without it (what copy does with a __reduce__, the code could
# do itself; the kernel keeps the process in). Every other dunder is introspection (__globals__, __dict__, __code__,
# __subclasses__, __mro__, __bases__, __self__, __builtins__, ...). tests/test_contract.py checks the language
# reference's list of the running Python against this one.
SAFE_DUNDERS = frozenset(
    {"__name__", "__qualname__", "__doc__", "__class__", "__slots__", "__all__", "__version__", "__author__",
     "__match_args__"}
    | {f"__{n}__" for n in (
        "init new post_init del repr str format bytes hash bool sizeof eq ne lt le gt ge getattr setattr delattr dir "
        "get set delete set_name call len length_hint getitem setitem delitem missing iter next reversed contains "
        "enter exit aenter aexit await aiter anext neg pos abs invert complex int float index round trunc floor ceil "
        "init_subclass class_getitem divmod rdivmod getattribute instancecheck subclasscheck prepare mro_entries "
        "buffer release_buffer "
        "copy deepcopy replace reduce reduce_ex getnewargs getnewargs_ex getstate setstate "
        "subclasshook isabstractmethod fspath"
    ).split()}
    | {f"__{p}{n}__" for p in ("", "r", "i") for n in (
        "add sub mul matmul truediv floordiv mod pow lshift rshift and xor or"
    ).split()}
)  # fmt: skip
# Private names of library objects that are their public interface (namedtuple's and enum's). Any other single-
# underscore attribute a strategy reads must be one of its own: a name it binds or assigns somewhere.
LIBRARY_PRIVATE_NAMES = frozenset(
    {"_asdict", "_replace", "_make", "_fields", "_field_defaults", "_value_", "_name_", "_missing_",
     "_generate_next_value_", "_ignore_", "_order_", "_member_names_", "_member_map_"}
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
# The same through the special methods, called: `object.__setattr__(self, "_n", v)` (how a frozen dataclass sets its
# own field in __post_init__), `super().__setattr__("_n", v)`. The name is the first string of the first two arguments.
ATTRIBUTE_METHODS = {"__setattr__": "setattr", "__delattr__": "delattr", "__getattribute__": "getattr",
                     "__getattr__": "getattr"}  # fmt: skip


def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def is_private(name: str) -> bool:
    return name.startswith("_") and not is_dunder(name)


def attribute_allowed(name: str) -> bool:
    """An attribute name a strategy may read or write: no dunder outside SAFE_DUNDERS, no introspection. (Private
    names are judged against the code's own.)"""
    return name not in INTROSPECTION_ATTRIBUTES and (not is_dunder(name) or name in SAFE_DUNDERS)


def public_names(module: str) -> list[str]:
    """The public names of an allowed module on this Python: dir() and __all__, which also holds the names a module
    makes on first use (3.13's typing makes Match, Pattern, ContextManager in its __getattr__, absent from dir())."""
    real = importlib.import_module(module)
    names = set(dir(real)) | set(getattr(real, "__all__", ()))
    return sorted(n for n in names if not n.startswith("_") and hasattr(real, n))


def served(module: str, name: str) -> bool:
    """Whether the sandbox's copy of an allowed module holds `name`. A public name this Python's module lacks counts
    as served: using it is an AttributeError, a mistake, not cheating."""
    if module == "sys":
        return name in SYS_NAMES
    if name.startswith("_"):
        return name in SAFE_DUNDERS  # a module object's own __name__, __doc__
    value = getattr(importlib.import_module(module), name, None)
    return not isinstance(value, types.ModuleType) or value.__name__ in MODULES


@functools.cache
def star_names(module: str) -> tuple[str, ...]:
    """What `from module import *` binds, in the sandbox as in the judge: the served names of the module's `__all__`
    when it has one (its copy's `__all__`), else every public name its copy holds."""
    real = importlib.import_module(module)
    if hasattr(real, "__all__"):
        return tuple(name for name in real.__all__ if served(module, name))
    names = SYS_NAMES if module == "sys" else public_names(module)
    return tuple(sorted(name for name in names if hasattr(real, name) and served(module, name)))


def prompt_rules() -> str:
    """The contract in the prompt's words (rewards.build_prompt): what the judge and the sandbox enforce, said once."""
    modules = ", ".join(m for m in sorted(MODULES) if m not in ("__future__", "collections.abc", "sys"))
    return (
        f"Plain Python; import only {modules}, sys for constants, getsizeof, recursion limit. Nothing outside its "
        "process (files, OS, processes). No eval, exec, open, __import__, globals, vars, frames, code objects, "
        "private _names of library objects, or dunders beyond special methods (__init__, __add__, __class__, ...). "
        "Top level: only imports, "
        'functions, classes, constants and an optional `if __name__ == "__main__":` test (never run).'
    )


# --- judging a syntax tree --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def judge(code: str) -> tuple[tuple[str, ...], str | None] | None:
    """(violations, structure problem) of source text, or None when it does not parse. Cached: the rewards and the
    sandbox ask about the same answers. The text is parsed, never compiled: parsing is linear in its length, compiling
    is not (a pattern match with many alternatives took seconds and gigabytes), so that is left to the sandbox's
    child, under its limits."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    found, structure = problems(tree)
    return tuple(found), structure


def problems(tree: ast.Module) -> tuple[list[str], str | None]:
    """(violations, structure problem) of a parsed module: what it uses that a strategy may not, each said once ([] when
    clean), and why it could not be played as a strategy (None when it can). One walk of the tree, then the checks
    that need to know every name the code binds."""
    found: dict[str, None] = {}
    bound: dict[str, int] = {}  # name -> how many times the code binds it
    aliases: dict[str, str] = {}  # name -> module, for a name an `import` binds
    own = set(LIBRARY_PRIVATE_NAMES)  # attributes the code assigns, and so may read back
    builtins_read, attributes_read, names_computed = [], [], []

    def refuse(what: str) -> None:
        found.setdefault(what)

    def bind(name: str) -> None:
        bound[name] = bound.get(name, 0) + 1

    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                bind(node.id)
            if is_dunder(node.id):
                if node.id not in SAFE_DUNDERS:
                    refuse(f"name {node.id!r}")
            elif isinstance(node.ctx, ast.Load) and node.id in _FORBIDDEN_BUILTINS:
                builtins_read.append(node.id)  # unless the code binds that name itself
        elif isinstance(node, ast.Attribute):
            if not attribute_allowed(node.attr):
                refuse(f"attribute {node.attr!r}")
            elif not isinstance(node.ctx, ast.Load):
                own.add(node.attr)
            else:
                attributes_read.append((node.value.id if isinstance(node.value, ast.Name) else None, node.attr))
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            if isinstance(func, ast.Name) and func.id in ATTRIBUTE_FUNCTIONS and len(args) > 1:
                if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                    names_computed.append((func.id, args[1].value))  # a name computed at run time is not seen
                    if func.id == "setattr":
                        own.add(args[1].value)
            elif isinstance(func, ast.Attribute) and func.attr in ATTRIBUTE_METHODS:
                name = next((a.value for a in args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
                if name is not None:
                    names_computed.append(("", name))  # "": no function of the code's own can be meant
                    if ATTRIBUTE_METHODS[func.attr] == "setattr":
                        own.add(name)
        elif isinstance(node, ast.arg):
            bind(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bind(node.name)
            if is_dunder(node.name) and node.name not in SAFE_DUNDERS:
                refuse(f"definition of {node.name!r}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.partition(".")[0]
                bind(name)
                if alias.name not in MODULES:
                    refuse(f"import of {alias.name!r}")
                else:
                    aliases[name] = alias.name if alias.asname else name
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module not in MODULES:
                refuse(f"import from {'.' * node.level}{module}")
            star = [alias.name for alias in node.names] == ["*"] and module in MODULES and not node.level
            for name in star_names(module) if star else ():
                bind(name)  # as plain Python binds them: re's `compile` is then re.compile, not the builtin
            for alias in node.names if not star else ():
                bind(alias.asname or alias.name)
                if module in MODULES and not node.level and not served(module, alias.name):
                    refuse(f"{module}.{alias.name}, which the contract leaves out")
        elif isinstance(node, ast.keyword):
            if node.arg and not attribute_allowed(node.arg):
                refuse(f"keyword {node.arg!r}")
        elif isinstance(node, ast.MatchClass):
            for attr in node.kwd_attrs:
                if not attribute_allowed(attr):
                    refuse(f"pattern attribute {attr!r}")
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            bind(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bind(node.rest)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            for name in node.names:
                bind(name)

    own |= {name for name in bound if is_private(name)}
    for name in builtins_read:
        if name not in bound:
            refuse(f"builtin {name!r}")
    for value, attr in attributes_read:
        module = aliases.get(value) if bound.get(value) == 1 else None
        if module is not None:
            if not served(module, attr):
                refuse(f"{module}.{attr}, which the contract leaves out")
        elif is_private(attr) and attr not in own:
            refuse(f"private attribute {attr!r} of a library object")
    for func, attr in names_computed:
        if func in bound:
            continue  # the code's own function of that name
        if not attribute_allowed(attr):
            refuse(f"attribute {attr!r}")
        elif is_private(attr) and attr not in own:
            refuse(f"private attribute {attr!r} of a library object")
    return list(found), structure_problem(tree) if isinstance(tree, ast.Module) else None


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round): a self-test that the sandbox never runs."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return isinstance(node.test.ops[0], ast.Eq) and len(names) == 1 and len(mains) == 1


# A `type X = ...` alias (3.12+) is a definition too: it binds a name and runs nothing until its value is read.
_TYPE_ALIAS = (ast.TypeAlias,) if sys.version_info >= (3, 12) else ()
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                ast.AnnAssign, ast.AugAssign, ast.Pass, *_TYPE_ALIAS)  # fmt: skip


def _top_level_names(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds in the module (a class's methods are its own)."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {alias.asname or alias.name.partition(".")[0] for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, ast.AnnAssign | ast.AugAssign) else [node.name] if isinstance(node, _TYPE_ALIAS) else []  # fmt: skip
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def structure_problem(tree: ast.Module) -> str | None:
    """Why the module is not one the loader plays, or None: it must define `strategy` once, taking the board, with
    only definitions (and constant docstrings, and main guards) at the top level."""
    strategies, elsewhere = [], 0
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "strategy":
            strategies.append(node)
            continue
        elsewhere += "strategy" in _top_level_names(node)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring or a stray string
        elif not isinstance(node, _DEFINITIONS) and not _is_main_guard(node):
            return f"top level holds a {type(node).__name__} statement (only imports and definitions go there)"
    if not strategies:
        return "no `def strategy(board)` at the top level"
    if len(strategies) + elsewhere > 1:
        return "`strategy` is defined more than once"
    if isinstance(strategies[0], ast.AsyncFunctionDef):
        return "`strategy` is a coroutine function"
    args = strategies[0].args
    if len(args.posonlyargs) + len(args.args) < 1 and args.vararg is None:
        return "`strategy` takes no board argument"
    return None
