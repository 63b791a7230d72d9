"""What a strategy may use: the one contract that the prompt states, the static judge (rewards.py) enforces and the
sandbox's loader serves.

A strategy is a module that defines `strategy(board)`, written in plain Python: the standard-library modules in
MODULES (each reduced to the names listed there), the builtins in ALLOWED_BUILTINS, its own classes with ordinary
special methods, and no introspection. `problems(tree)` reads the syntax tree alone and says what the code breaks:

- `violations`: it reaches for something the contract forbids (a module outside MODULES, eval, a frame, a dunder
  such as `__globals__`): the rewards score it as cheating and never play it, the loader refuses it;
- `structure`: it is not a module the loader can play (no `def strategy(board)`, statements other than definitions at
  the top level, a name the sandbox's module copies leave out such as `functools.singledispatch`): not played, not
  cheating.

This layer fails fast and says why. It is not the boundary: the sandbox assumes any code can break out of Python; its
child reports every way back to eval, exec, imports, frames or the OS as a violation at run time (an audit hook), and
keeps the machine safe with OS-level walls (docs/SECURITY.md).
"""

from __future__ import annotations

import ast
import builtins
import keyword

# The standard-library modules a strategy may import, each with the names it gets from it: pure computation, without
# the helpers that evaluate strings, read other modules or reach the interpreter (typing.get_type_hints, ForwardRef,
# functools.singledispatch, string.Formatter, dataclasses.make_dataclass, ...). "*" is every public name of a module
# written in C with nothing of that kind. A name missing in this Python's version of a module is left out.
EVERYTHING = frozenset({"*"})
MODULES: dict[str, frozenset[str]] = {
    "__future__": frozenset({"annotations"}),
    "abc": frozenset({"ABC", "ABCMeta", "abstractmethod"}),
    "array": frozenset({"array", "typecodes"}),
    "bisect": EVERYTHING,
    "cmath": EVERYTHING,
    "collections": frozenset({"ChainMap", "Counter", "OrderedDict", "UserDict", "UserList", "UserString", "abc",
                              "defaultdict", "deque", "namedtuple"}),
    "collections.abc": frozenset({
        "AsyncGenerator", "AsyncIterable", "AsyncIterator", "Awaitable", "Callable", "Collection", "Container",
        "Coroutine", "Generator", "Hashable", "ItemsView", "Iterable", "Iterator", "KeysView", "Mapping",
        "MappingView", "MutableMapping", "MutableSequence", "MutableSet", "Reversible", "Sequence", "Set", "Sized",
        "ValuesView",
    }),
    "contextlib": frozenset({"AbstractContextManager", "ExitStack", "closing", "contextmanager", "nullcontext",
                             "suppress"}),
    "copy": frozenset({"copy", "deepcopy", "Error"}),
    "dataclasses": frozenset({"FrozenInstanceError", "InitVar", "KW_ONLY", "MISSING", "asdict", "astuple", "dataclass",
                              "field", "fields", "is_dataclass", "replace"}),
    "decimal": EVERYTHING,
    "enum": frozenset({"Enum", "Flag", "IntEnum", "IntFlag", "StrEnum", "auto", "unique"}),
    "fractions": frozenset({"Fraction"}),
    "functools": frozenset({"cache", "cached_property", "cmp_to_key", "lru_cache", "partial", "partialmethod",
                            "reduce", "total_ordering", "update_wrapper", "wraps"}),
    "heapq": EVERYTHING,
    "itertools": EVERYTHING,
    "math": EVERYTHING,
    "numbers": frozenset({"Complex", "Integral", "Number", "Rational", "Real"}),
    "operator": EVERYTHING,  # attrgetter and methodcaller: the sandbox's checked versions
    "random": frozenset({
        "Random", "betavariate", "binomialvariate", "choice", "choices", "expovariate", "gammavariate", "gauss",
        "getrandbits", "getstate", "lognormvariate", "normalvariate", "paretovariate", "randbytes", "randint",
        "random", "randrange", "sample", "seed", "setstate", "shuffle", "triangular", "uniform", "vonmisesvariate",
        "weibullvariate",
    }),
    "re": frozenset({
        "A", "ASCII", "DOTALL", "I", "IGNORECASE", "M", "MULTILINE", "Match", "NOFLAG", "Pattern", "S", "U", "UNICODE",
        "VERBOSE", "X", "compile", "error", "escape", "findall", "finditer", "fullmatch", "match", "purge", "search",
        "split", "sub", "subn",
    }),
    "statistics": frozenset({
        "NormalDist", "StatisticsError", "correlation", "covariance", "fmean", "geometric_mean", "harmonic_mean",
        "linear_regression", "mean", "median", "median_grouped", "median_high", "median_low", "mode", "multimode",
        "pstdev", "pvariance", "quantiles", "stdev", "variance",
    }),
    "string": frozenset({"Template", "ascii_letters", "ascii_lowercase", "ascii_uppercase", "capwords", "digits",
                         "hexdigits", "octdigits", "printable", "punctuation", "whitespace"}),
    "sys": frozenset({"byteorder", "float_info", "getrecursionlimit", "getsizeof", "hash_info", "int_info", "maxsize",
                      "maxunicode", "setrecursionlimit", "version_info"}),
    "time": frozenset({
        "asctime", "ctime", "gmtime", "localtime", "mktime", "monotonic", "monotonic_ns", "perf_counter",
        "perf_counter_ns", "process_time", "process_time_ns", "sleep", "strftime", "strptime", "struct_time", "time",
        "time_ns",
    }),
    "typing": frozenset({
        "Annotated", "Any", "AnyStr", "Callable", "ClassVar", "Collection", "Container", "Counter", "DefaultDict",
        "Deque", "Dict", "Final", "FrozenSet", "Generator", "Generic", "Hashable", "Iterable", "Iterator", "List",
        "Literal", "Mapping", "MutableMapping", "MutableSequence", "MutableSet", "NamedTuple", "NewType", "NoReturn",
        "Optional", "OrderedDict", "Protocol", "Reversible", "Self", "Sequence", "Set", "Sized", "SupportsAbs",
        "SupportsFloat", "SupportsIndex", "SupportsInt", "SupportsRound", "TYPE_CHECKING", "Text", "Tuple", "Type",
        "TypeAlias", "TypeVar", "TypedDict", "Union", "cast", "final", "overload",
    }),
}  # fmt: skip
ALLOWED_MODULES = frozenset(MODULES)

# Builtins a strategy may call; the sandbox gives it these and no others. getattr & co. are there, checked by the
# sandbox at run time, so a name computed at run time is held to the same rule as a written one.
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

# Double-underscore names a strategy may define, read and call: Python's data model (what operators, protocols and
# ordinary classes use) and a few names. Every other dunder is introspection or a way to hand the interpreter a name
# to look up (__globals__, __dict__, __code__, __subclasses__, __mro__, __bases__, __match_args__, __reduce__, ...).
SAFE_DUNDERS = frozenset(
    {"__name__", "__qualname__", "__doc__", "__class__", "__slots__", "__all__", "__version__", "__author__"}
    | {f"__{n}__" for n in (
        "init new post_init del repr str format bytes hash bool sizeof eq ne lt le gt ge getattr dir get set delete "
        "set_name call len length_hint getitem setitem delitem missing iter next reversed contains enter exit aenter "
        "aexit await aiter anext neg pos abs invert complex int float index round trunc floor ceil copy deepcopy "
        "init_subclass class_getitem divmod rdivmod"
    ).split()}
    | {f"__{p}{n}__" for p in ("", "r", "i") for n in (
        "add sub mul matmul truediv floordiv mod pow lshift rshift and xor or"
    ).split()}
)  # fmt: skip
# Definable in a class, but read only as `object.__setattr__(...)` or `super().__setattr__(...)`: anything else hands
# a computed name to setattr without the sandbox's check.
ATTRIBUTE_HOOKS = frozenset({"__setattr__", "__delattr__"})
# Private names of library objects that are their public interface (namedtuple's and enum's). Every other single-
# underscore attribute a strategy reads must be one of its own (a name it binds or assigns somewhere): the stdlib's
# private helpers read other modules (Enum._convert_ reads sys.modules) or evaluate strings (ForwardRef._evaluate).
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
_ALL_BUILTINS = frozenset(dir(builtins))


def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def module_allowed(name: str) -> bool:
    return name in MODULES


def module_provides(module: str, name: str) -> bool:
    """Whether the sandbox's copy of an allowed module has `name` (a name missing from this Python is not checked
    here: the loader leaves it out, and using it is an AttributeError like any other)."""
    names = MODULES[module]
    if is_dunder(name):
        return name in SAFE_DUNDERS  # a module object's own __name__, __doc__, __class__
    return name in names or (names is EVERYTHING and not name.startswith("_"))


def is_private(name: str) -> bool:
    return name.startswith("_") and not is_dunder(name)


def own_private_names(tree: ast.AST) -> frozenset[str]:
    """The single-underscore names the code binds or assigns anywhere (`self._memo = ...`, `def _helper`, a `_cache`
    constant, `setattr(x, "_n", ...)`): the private attributes it may read back, with LIBRARY_PRIVATE_NAMES."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
    names |= set(_bindings(tree))
    return frozenset(n for n in names if is_private(n)) | LIBRARY_PRIVATE_NAMES


def attribute_allowed(name: str) -> bool:
    """An attribute name a strategy may read or write: no dunder outside SAFE_DUNDERS, no introspection. (Private
    names are judged against the code's own: own_private_names.)"""
    return name not in INTROSPECTION_ATTRIBUTES and (not is_dunder(name) or name in SAFE_DUNDERS)


def field_name_allowed(name) -> bool:
    """A name that code generators (dataclasses, namedtuple) may write into source text: an exact `str` that is an
    identifier, not a keyword, and an allowed attribute."""
    return type(name) is str and name.isidentifier() and not keyword.iskeyword(name) and attribute_allowed(name)


def prompt_rules() -> str:
    """The contract in the prompt's words (rewards.build_prompt): what the judge and the loader enforce, said once."""
    modules = ", ".join(m for m in sorted(MODULES) if m not in ("__future__", "collections.abc", "sys"))
    return (
        f"Plain Python; import only {modules}, and sys for its constants (eval-like helpers such as "
        "functools.singledispatch are left out). No eval, exec, open, __import__, globals, vars, frames, code "
        "objects, private _names of library objects, or dunders beyond special methods (__init__, __add__, "
        "__class__, ...). Top level: only imports, "
        'functions, classes, constants and an optional `if __name__ == "__main__":` test (never run).'
    )


# --- judging a syntax tree --------------------------------------------------------------------------------------


def _bindings(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """Every name the code binds anywhere, with the nodes that bind it: assignments, parameters, defs, imports, ..."""
    bound: dict[str, list[ast.AST]] = {}

    def bind(name: str, node: ast.AST) -> None:
        bound.setdefault(name, []).append(node)

    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bind(node.id, node)
        elif isinstance(node, ast.arg):
            bind(node.arg, node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bind(node.name, node)
        elif isinstance(node, ast.alias):
            bind(node.asname or node.name.partition(".")[0], node)
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            bind(node.name, node)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bind(node.rest, node)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            for name in node.names:
                bind(name, node)
    return bound


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round): a self-test that the sandbox never runs."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return isinstance(node.test.ops[0], ast.Eq) and len(names) == 1 and len(mains) == 1


_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                ast.AnnAssign, ast.AugAssign, ast.Pass)  # fmt: skip


def _top_level_names(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds in the module (a class's methods are its own)."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {alias.asname or alias.name.partition(".")[0] for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, ast.AnnAssign | ast.AugAssign) else []  # fmt: skip
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


def problems(tree: ast.Module) -> tuple[list[str], str | None]:
    """(violations, structure problem) of a parsed module: what it uses that a strategy may not, each said once in
    the order found ([] when clean), and why it could not be played as a strategy (None when it can).

    Linear in the size of the tree: a few walks.
    """
    bound = _bindings(tree)
    own = own_private_names(tree)
    found: dict[str, None] = {}
    unavailable: dict[str, None] = {}
    imported = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    module_aliases = {  # name -> module, for names bound only by `import module [as name]`
        name: nodes[0].name
        for name, nodes in bound.items()
        if len(nodes) == 1 and id(nodes[0]) in imported and module_allowed(nodes[0].name)
        and (nodes[0].asname or "." not in nodes[0].name)
    }  # fmt: skip

    def refuse(what: str) -> None:
        found.setdefault(what)

    for name, nodes in bound.items():  # a dunder bound any other way than a def or an assignment of a safe one
        if is_dunder(name):
            for node in nodes:
                defined = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and name in SAFE_DUNDERS | ATTRIBUTE_HOOKS
                assigned = isinstance(node, ast.Name) and name in SAFE_DUNDERS - {"__class__"}
                if not (defined or assigned):
                    refuse(f"binding of {name!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not module_allowed(alias.name):
                    refuse(f"import of {alias.name!r}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or not module_allowed(module):
                refuse(f"import from {'.' * node.level}{module}")
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                if not attribute_allowed(alias.name):
                    refuse(f"import of {module}.{alias.name}")
                elif not module_provides(module, alias.name):
                    unavailable.setdefault(f"{module}.{alias.name}")
        elif isinstance(node, ast.Name):
            if is_dunder(node.id):
                if node.id not in SAFE_DUNDERS:
                    refuse(f"name {node.id!r}")
            elif isinstance(node.ctx, ast.Load) and node.id not in bound and node.id in _ALL_BUILTINS:
                if node.id not in ALLOWED_BUILTINS:
                    refuse(f"builtin {node.id!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr in ATTRIBUTE_HOOKS:
                if not _plain_object_or_super(node.value, bound):
                    refuse(f"attribute {node.attr!r} (only object.{node.attr} or super().{node.attr})")
            elif not attribute_allowed(node.attr):
                refuse(f"attribute {node.attr!r}")
            elif isinstance(node.value, ast.Name) and node.value.id in module_aliases:
                module = module_aliases[node.value.id]
                if not module_provides(module, node.attr):
                    unavailable.setdefault(f"{module}.{node.attr}")
            elif is_private(node.attr) and node.attr not in own:
                refuse(f"private attribute {node.attr!r} of a library object")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if is_dunder(node.name) and node.name not in SAFE_DUNDERS | ATTRIBUTE_HOOKS:
                refuse(f"definition of {node.name!r}")
        elif isinstance(node, ast.keyword):
            if node.arg and not attribute_allowed(node.arg):
                refuse(f"keyword {node.arg!r}")
        elif isinstance(node, ast.MatchClass):
            # A class pattern reads attributes: named ones are written out; positional ones come from the class's
            # __match_args__, which the code could have set to anything on a class it did not define with a class
            # statement. Positional patterns go with builtin types (int(x)) and the code's own classes.
            for attr in node.kwd_attrs:
                if not attribute_allowed(attr):
                    refuse(f"pattern attribute {attr!r}")
            if node.patterns and not _own_class_or_builtin(node.cls, bound):
                refuse("positional class pattern on a class that is not a plain class of the code's own")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
            name = node.args[1] if len(node.args) > 1 else None
            if node.func.id not in bound and isinstance(name, ast.Constant) and isinstance(name.value, str):
                if not attribute_allowed(name.value):
                    refuse(f"attribute {name.value!r}")
                elif is_private(name.value) and name.value not in own:
                    refuse(f"private attribute {name.value!r} of a library object")
            # A computed name is checked when it is used (the sandbox's getattr & co.).
    structure = structure_problem(tree) if isinstance(tree, ast.Module) else None
    if structure is None and unavailable:
        structure = "uses " + ", ".join(unavailable) + ", which the sandbox does not provide"
    return list(found), structure


def _plain_object_or_super(node: ast.expr, bound: dict) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "object" and "object" not in bound
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
        and "super" not in bound and not node.args and not node.keywords
    )  # fmt: skip


def _own_class_or_builtin(node: ast.expr, bound: dict) -> bool:
    """A builtin type not rebound, or a plain class of the code's own: defined by one class statement and bound nowhere
    else, without a metaclass, on bases that are such classes too (or object, or NamedTuple). Nothing else can give a
    class a __match_args__ naming an attribute the code could not read itself, or match a subject of another type."""
    if not isinstance(node, ast.Name):
        return False
    bindings = bound.get(node.id, [])
    if not bindings:
        return node.id in ALLOWED_BUILTINS and isinstance(getattr(builtins, node.id, None), type)
    return _plain_own_class(node.id, bound, seen=set())


def _plain_own_class(name: str, bound: dict, seen: set) -> bool:
    bindings = bound.get(name, [])
    if name in seen or len(bindings) != 1 or not isinstance(bindings[0], ast.ClassDef):
        return False
    seen.add(name)
    cls = bindings[0]
    if cls.keywords:
        return False
    for base in cls.bases:
        if isinstance(base, ast.Attribute) and base.attr == "NamedTuple":
            continue
        if not isinstance(base, ast.Name):
            return False
        if base.id in ("object", "NamedTuple") and len(bound.get(base.id, [])) <= 1:
            continue
        if not _plain_own_class(base.id, bound, seen):
            return False
    return True
