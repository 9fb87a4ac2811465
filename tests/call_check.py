"""Static check that a test module's calls into ``dtensor_fp8`` still match the library.

Used by tests/test_gpu_suite_calls.py on tests/gpu, whose modules skip on a machine without CUDA or
TE, so their calls run only where a GPU is lent and can rot unseen in between (issue 41: a test
still called ``requantize_from_hp_`` with an argument the function had lost).

[Note: what the call check resolves]
Each module is read with ``ast``, never run. A name is resolved through the bindings of its scope
(module, function; innermost first, as Python looks it up):

* an import of ``dtensor_fp8`` or of something in it (``import dtensor_fp8 as d``,
  ``from dtensor_fp8.requantize import requantize_from_hp_``, in any scope) binds the object
  imported;
* ``x = <call>`` binds an instance of a ``dtensor_fp8`` class: the class called, or the class a
  called function's return annotation names (``q = d.quantize(w, r)`` -> ``QuantizedTensor``);
* any other binding (an argument, a loop target, an unpacking, a second ``x = ...`` of another
  kind) makes the name opaque there: its calls are not checked.

An attribute chain on a resolved object is followed with ``getattr`` (importing submodules on the
way); a missing attribute of a ``dtensor_fp8`` module or class is a problem whether called or not.
A method looked up on an instance's class (``inspect.getattr_static``) is checked when the library
defines it (methods torch.Tensor gives ``QuantizedTensor`` are not); an attribute an instance sets
itself is not visible statically and is left unresolved. Each call to a resolved ``dtensor_fp8``
callable binds its positional and keyword arguments to ``inspect.signature`` of the callable as
the library defines it now; a call with ``*args`` / ``**kwargs`` is left unresolved.

Shell scripts: each ``python -m dtensor_fp8.benchmarks <subcommand> --option ...`` names a
subcommand of ``benchmarks/__main__.py`` and options its ``--help`` lists, and each
``tests/...py`` path a script hands pytest exists.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import re
import shlex
import types
import typing
from pathlib import Path

PACKAGE = "dtensor_fp8"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Report:
    """What a check found.

    Attributes:
        checked: ``"file:line target"`` of every call whose arguments were bound to the signature.
        unresolved: calls rooted in ``dtensor_fp8`` names that could not be resolved statically.
        problems: one sentence each: where, the call, and why it does not match the library.
    """

    checked: list[str] = dataclasses.field(default_factory=list)
    unresolved: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def merge(self, other: "Report") -> None:
        self.checked += other.checked
        self.unresolved += other.unresolved
        self.problems += other.problems


class _Missing(Exception):
    """An attribute that a ``dtensor_fp8`` module or class does not have."""


class _Unresolvable(Exception):
    """Something that cannot be resolved here (an optional dependency of a submodule is missing)."""


_OPAQUE = ("opaque",)  # a binding the check does not follow


def _in_package(obj) -> bool:
    module = getattr(obj, "__module__", None) or (obj.__name__ if isinstance(obj, types.ModuleType) else None)
    return isinstance(module, str) and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _getattr(obj, name: str, dotted: str):
    """``obj.name``; a submodule of a package is imported first if need be."""
    if isinstance(obj, types.ModuleType):
        try:
            return getattr(obj, name)
        except AttributeError:
            pass
        full = f"{obj.__name__}.{name}"
        try:
            return importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name == full:
                raise _Missing(f"{dotted}: module {obj.__name__} has no attribute {name!r}") from None
            raise _Unresolvable(f"{full} needs {e.name}") from None
        except ImportError as e:
            raise _Unresolvable(f"{full}: {e}") from None
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _Missing(f"{dotted}: {getattr(obj, '__qualname__', obj)} has no attribute {name!r}") from None


def _import(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        obj = _getattr(obj, part, ".".join(parts[: i + 1]))
    return obj


def _returned_class(fn) -> type | None:
    """The ``dtensor_fp8`` class that ``fn``'s return annotation names (``X``, ``X | None``)."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001  (an annotation that does not evaluate: not followed)
        return None
    if hint is None:
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else [hint]
    if len(args) == 1 and isinstance(args[0], type) and _in_package(args[0]):
        return args[0]
    return None


class _Scope:
    def __init__(self, node, parent: "_Scope | None"):
        self.node, self.parent = node, parent
        self.stores: dict[str, list] = {}  # name -> binding statements / nodes
        self.resolved: dict[str, tuple] = {}
        self.resolving: set[str] = set()


class _Checker(ast.NodeVisitor):
    def __init__(self, filename: str):
        self.filename = filename
        self.report = Report()
        self.scopes: dict[ast.AST, _Scope] = {}

    # ---- scopes and bindings ------------------------------------------------------------------------
    def build(self, tree: ast.Module) -> None:
        def walk(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    if not isinstance(child, ast.Lambda):
                        scope.stores.setdefault(child.name, []).append(_OPAQUE)
                    inner = self.scopes[child] = _Scope(child, scope)
                    for arg in [*child.args.posonlyargs, *child.args.args, *child.args.kwonlyargs,
                                child.args.vararg, child.args.kwarg]:
                        if arg is not None:
                            inner.stores.setdefault(arg.arg, []).append(_OPAQUE)
                    walk(child, inner)
                    continue
                if isinstance(child, ast.ClassDef):  # its body binds in the enclosing scope (conservative)
                    scope.stores.setdefault(child.name, []).append(_OPAQUE)
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.asname:
                            scope.stores.setdefault(alias.asname, []).append(("import", alias.name))
                        else:
                            root = alias.name.split(".")[0]
                            scope.stores.setdefault(root, []).append(("import", root))
                elif isinstance(child, ast.ImportFrom):
                    for alias in child.names:
                        name = alias.asname or alias.name
                        if child.level == 0 and child.module and alias.name != "*":
                            scope.stores.setdefault(name, []).append(("import", f"{child.module}.{alias.name}"))
                        else:
                            scope.stores.setdefault(name, []).append(_OPAQUE)
                elif isinstance(child, ast.Assign) and len(child.targets) == 1 and isinstance(child.targets[0], ast.Name):
                    scope.stores.setdefault(child.targets[0].id, []).append(("assign", child.value))
                    walk(child.value, scope)
                    continue
                elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
                    scope.stores.setdefault(child.id, []).append(_OPAQUE)
                elif isinstance(child, ast.ExceptHandler) and child.name:
                    scope.stores.setdefault(child.name, []).append(_OPAQUE)
                elif isinstance(child, (ast.Global, ast.Nonlocal)):
                    for name in child.names:
                        scope.stores.setdefault(name, []).append(_OPAQUE)
                walk(child, scope)

        self.module_scope = self.scopes[tree] = _Scope(tree, None)
        walk(tree, self.module_scope)

    def binding(self, name: str, scope: _Scope) -> tuple:
        """``("object", obj)``, ``("instance", cls)`` or :data:`_OPAQUE` for ``name`` in ``scope``."""
        while scope is not None and name not in scope.stores:
            scope = scope.parent
        if scope is None:
            return _OPAQUE  # a builtin or a name the module never binds
        if name in scope.resolved:
            return scope.resolved[name]
        if name in scope.resolving:  # x = f(x): not followed
            return _OPAQUE
        scope.resolving.add(name)
        try:
            kinds = {self._binding_of(store, scope) for store in scope.stores[name]}
        finally:
            scope.resolving.discard(name)
        result = kinds.pop() if len(kinds) == 1 else _OPAQUE
        scope.resolved[name] = result
        return result

    def _binding_of(self, store, scope) -> tuple:
        if store[0] == "import":
            dotted = store[1]
            if dotted.split(".")[0] != PACKAGE:
                return _OPAQUE
            try:
                return ("object", _import(dotted))
            except (_Missing, _Unresolvable):  # a missing name is reported by check_imports
                return _OPAQUE
        if store[0] == "assign":
            cls = self.instance_class(store[1], scope)
            return ("instance", cls) if cls is not None else _OPAQUE
        return _OPAQUE

    # ---- expressions ---------------------------------------------------------------------------------
    def resolve(self, node, scope) -> tuple:
        """``("object", obj)`` (something of the library), ``("member", cls, raw)`` (a class attribute
        looked up for an instance), ``("instance", cls)``, or :data:`_OPAQUE`."""
        if isinstance(node, ast.Name):
            return self.binding(node.id, scope)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value, scope)
            if base[0] == "object" and (isinstance(base[1], (types.ModuleType, type)) and _in_package(base[1])):
                try:
                    return ("object", _getattr(base[1], node.attr, ast.unparse(node)))
                except _Missing as e:
                    self.problem(node, str(e))
                except _Unresolvable:
                    pass
                return _OPAQUE
            if base[0] == "instance":
                try:
                    return ("member", base[1], inspect.getattr_static(base[1], node.attr))
                except AttributeError:
                    return _OPAQUE  # an attribute the instance sets itself
            return _OPAQUE
        if isinstance(node, ast.Call):
            cls = self.instance_class(node, scope)
            return ("instance", cls) if cls is not None else _OPAQUE
        return _OPAQUE

    def instance_class(self, node, scope) -> type | None:
        """The ``dtensor_fp8`` class of what ``node`` evaluates to, where a call says so."""
        if isinstance(node, ast.Name):
            b = self.binding(node.id, scope)
            return b[1] if b[0] == "instance" else None
        if not isinstance(node, ast.Call):
            return None
        f = self.resolve(node.func, scope)
        if f[0] == "object":
            if isinstance(f[1], type):
                return f[1] if _in_package(f[1]) else None
            return _returned_class(f[1]) if callable(f[1]) else None
        if f[0] == "member":
            raw = f[2]
            fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            return _returned_class(fn) if inspect.isfunction(fn) else None
        return None

    # ---- calls ---------------------------------------------------------------------------------------
    def where(self, node) -> str:
        return f"{self.filename}:{getattr(node, 'lineno', '?')}"

    def problem(self, node, why: str) -> None:
        self.report.problems.append(f"{self.where(node)}: {why}")

    def check_imports(self, tree) -> None:
        """Every name imported from ``dtensor_fp8`` exists, in whatever scope it is imported."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
            else:
                continue
            for dotted in names:
                if dotted.split(".")[0] == PACKAGE:
                    try:
                        _import(dotted)
                    except _Missing as e:
                        self.problem(node, f"import: {e}")
                    except _Unresolvable:
                        self.report.unresolved.append(f"{self.where(node)} import {dotted}")

    def check_calls(self, tree) -> None:
        for node, scope in self._nodes_with_scopes(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self.resolve(node, scope)  # reports a missing attribute, called or not
            if isinstance(node, ast.Call):
                self.check_call(node, scope)

    def _nodes_with_scopes(self, tree):
        def walk(node, scope):
            for child in ast.iter_child_nodes(node):
                yield child, scope
                yield from walk(child, self.scopes.get(child, scope))

        yield from walk(tree, self.module_scope)

    def check_call(self, call: ast.Call, scope) -> None:
        f = self.resolve(call.func, scope)
        text = ast.unparse(call)
        text = text if len(text) <= 140 else text[:137] + "..."
        if f[0] == "object":
            fn, bound_self = f[1], False
            if not callable(fn) or not _in_package(fn):
                return
            target = f"{fn.__module__}.{getattr(fn, '__qualname__', fn)}"
        elif f[0] == "member":
            cls, raw = f[1], f[2]
            if isinstance(raw, staticmethod):
                fn, bound_self = raw.__func__, False
            elif isinstance(raw, classmethod):
                fn, bound_self = raw.__func__, True
            elif inspect.isfunction(raw):
                fn, bound_self = raw, True
            else:
                self.report.unresolved.append(f"{self.where(call)} {text} (a {type(raw).__name__})")
                return
            if not _in_package(fn):
                return  # e.g. a torch.Tensor method of QuantizedTensor
            target = f"{fn.__module__}.{fn.__qualname__}"
        else:
            root = call.func
            while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and self.binding(root.id, scope)[0] in ("object", "instance"):
                self.report.unresolved.append(f"{self.where(call)} {text}")
            return
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            self.report.unresolved.append(f"{self.where(call)} {text} (*args / **kwargs)")
            return
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            self.report.unresolved.append(f"{self.where(call)} {text} (no signature)")
            return
        args = [object()] * (len(call.args) + bound_self)
        try:
            sig.bind(*args, **{k.arg: object() for k in call.keywords})
        except TypeError as e:
            self.problem(call, f"{text} does not match {target}{sig}: {e}")
            return
        self.report.checked.append(f"{self.where(call)} {target}")


def check_source(source: str, filename: str = "<source>") -> Report:
    """Check every call into ``dtensor_fp8`` in ``source`` (see [Note: what the call check resolves]).

    Args:
        source: a Python module's text.
        filename: how the report names it.

    Example:
        >>> check_source("from dtensor_fp8.requantize import requantize_from_hp_\\n"
        ...              "requantize_from_hp_([], {})\\n").problems
        ['<source>:2: requantize_from_hp_([], {}) does not match ...: too many positional arguments']
    """
    tree = ast.parse(source, filename)
    checker = _Checker(filename)
    checker.build(tree)
    checker.check_imports(tree)
    checker.check_calls(tree)
    report = checker.report
    report.problems = list(dict.fromkeys(report.problems))  # an attribute is resolved once per use in a chain
    return report


def check_file(path: Path) -> Report:
    return check_source(path.read_text(), str(path.relative_to(REPO) if path.is_absolute() else path))


# ---- shell scripts ----------------------------------------------------------------------------------
_SHELL_STOP = re.compile(r"^(\||\|\||&&|;|&|>|>>|2>|2>&1|<|\)|\}|\d*>.*)$")


@functools.cache
def _accepted_options(subcommand: str) -> frozenset[str]:
    """The options a benchmark subcommand's parser accepts, read from its ``--help`` (argparse prints
    every option, those added by helpers such as ``shapes.add_shape_arguments`` included)."""
    from dtensor_fp8.benchmarks.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([subcommand, "--help"])
        except SystemExit:
            pass
    return frozenset(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", out.getvalue()))


def _commands(script: str):
    """Each command of a shell script as a token list (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", script)
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote (a heredoc's body): not a command of ours
            continue
        if tokens:
            yield tokens


def check_shell(script: str, filename: str = "<script>") -> Report:
    """Check the ``python -m dtensor_fp8.benchmarks`` invocations and the test paths of a script.

    Args:
        script: the text of a bash script.
        filename: how the report names it.

    Example:
        >>> check_shell("python -m dtensor_fp8.benchmarks quantize --no-such-option\\n").problems
        ["<script>: python -m dtensor_fp8.benchmarks quantize: no option '--no-such-option' ..."]
    """
    from dtensor_fp8.benchmarks.__main__ import SUBCOMMANDS

    report = Report()
    for tokens in _commands(script):
        for i, tok in enumerate(tokens):
            if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] == f"{PACKAGE}.benchmarks":
                sub = tokens[i + 2] if i + 2 < len(tokens) else None
                where = f"{filename}: python -m {PACKAGE}.benchmarks {sub}"
                if sub not in SUBCOMMANDS:
                    report.problems.append(f"{where}: no such subcommand (have {sorted(SUBCOMMANDS)})")
                    continue
                declared = _accepted_options(sub)
                for opt in tokens[i + 3:]:
                    if _SHELL_STOP.match(opt):
                        break
                    name = opt.split("=", 1)[0]
                    if name.startswith("--") and name not in declared:
                        report.problems.append(f"{where}: no option {name!r} (its --help lists {sorted(declared)})")
                report.checked.append(f"{filename} benchmarks {sub}")
            elif re.fullmatch(r"tests/[\w/.-]+\.py(::.*)?", tok):
                path = tok.split("::")[0]
                if (REPO / path).is_file():
                    report.checked.append(f"{filename} {path}")
                else:
                    report.problems.append(f"{filename}: {path} does not exist")
    return report
