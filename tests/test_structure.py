"""The package's shape: layers without import cycles, small files, private torch API in one place.

Imports are read from the source (``ast``), module-level and function-level alike: a function-level
import is still a dependency, only a later one. An import names the module it reads from
(``from .ops.slicing import chunk_of`` -> ``ops.slicing``; ``from . import fsdp`` -> ``fsdp``);
the parent packages' ``__init__`` files that Python runs on the way are not counted, since every
module's import runs ``dtensor_fp8/__init__.py``, which imports the public API of all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dtensor_fp8"
MAX_LINES = 600

#: Known exceptions to the size rule, files a split is pending for (none at the moment: add one with
#: the issue that splits it, and remove it when that lands).
OVERSIZE_PENDING_SPLIT: set[str] = set()

#: Known import cycles in files another piece of work owns (none at the moment; the optimizer /
#: checkpoint rework of issues 17/20 removed checkpoint -> master -> module -> checkpoint).
CYCLES_PENDING_REWORK: set[tuple[str, ...]] = set()

#: Layers, lowest first: a module imports only modules of its own layer or below (and the cycle
#: test keeps each layer acyclic). ``te`` plugs in from the top: nothing below imports it.
LAYERS = [
    ("recipes", ["settings", "_compat", "fix_hints", "layout", "formats", "formats.*"]),
    ("tensor", ["op_table", "lifecycle", "entry", "owner_protocols", "param_state", "tensor", "quantize", "gemm", "linear"]),
    ("distributed", ["ops", "ops.*", "placement", "groups", "agreement", "scale_slots", "fsdp_buffers", "fsdp_completion", "fsdp_unsharded", "fsdp", "tp", "comm", "grouped_mm", "grouped_fp8",
                     "requantize", "param_writes"]),
    ("training / checkpoint", ["operand_scaling", "optim", "optim_follow", "optim_load", "optim_masters", "optim_state", "module", "expert_entries", "state_dict", "hp_load", "checkpoint", "checkpoint.*", "export_fp8",
                               "describe"]),
    ("top", ["te", "te_tensor", "__init__", "benchmarks", "benchmarks.*", "integrations", "integrations.*"]),
]

#: Private torch modules (a path component starting with "_") that files other than _compat.py may
#: import: the tensor-subclass protocol (see the note in _compat.py).
ALLOWED_PRIVATE_TORCH = {"torch.utils._pytree", "torch.utils._python_dispatch"}
#: Files still importing private torch modules, owned by other work in progress (none at the moment:
#: checkpoint/ calls _compat.flatten_state_dict / _compat.set_state_dict_element).
PRIVATE_TORCH_PENDING: dict[str, set[str]] = {}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package_parts(name: str) -> list[str]:
    """The package a module belongs to (itself, for a package's ``__init__``), as parts."""
    if name == "__init__":
        return []
    parts = name.split(".")
    return parts if (PACKAGE / "/".join(parts) / "__init__.py").exists() else parts[:-1]


def _ours(parts: list[str]) -> str:
    return ".".join(parts) or "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str) -> tuple[set[str], set[str]]:
    """(package modules, torch modules) that module ``name`` imports anywhere in its file."""
    ours, torch_mods = set(), set()
    tree = ast.parse(MODULES[name].read_text())
    type_only = {id(n) for guard in ast.walk(tree) if isinstance(guard, ast.If) and _is_type_checking(guard.test)
                 for stmt in guard.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:  # ``if TYPE_CHECKING:`` imports are for annotations only
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")
                if top[0] == "dtensor_fp8":
                    ours.add(_ours(top[1:]))
                elif top[0] == "torch":
                    torch_mods.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_parts(name)
                base = base[: len(base) - (node.level - 1)]
                full = base + (node.module.split(".") if node.module else [])
            elif node.module.split(".")[0] == "dtensor_fp8":
                full = node.module.split(".")[1:]
            else:
                if node.module.split(".")[0] == "torch":
                    torch_mods.add(node.module)
                continue
            for alias in node.names:  # ``from pkg import submodule`` names the submodule
                sub = _ours(full + [alias.name])
                ours.add(sub if sub in MODULES else _ours(full))
    ours.discard(name)
    return ours & set(MODULES), torch_mods


GRAPH = {name: imports_of(name)[0] for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every elementary cycle's module set, as a sorted tuple (Tarjan's strongly connected components:
    a component of more than one module is a cycle)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), set()
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer_of(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
                return i
    raise AssertionError(f"dtensor_fp8/{name}: a module in no layer; add it to LAYERS in tests/test_structure.py")


def test_the_import_graph_is_read():
    # The reader sees both kinds of import: module level (fsdp -> tensor) and inside a function
    # (te -> fsdp in quantize_te_module_).
    assert "tensor" in GRAPH["fsdp"] and "fsdp" in GRAPH["te"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_no_import_cycle():
    found = _cycles(GRAPH)
    unexpected = found - CYCLES_PENDING_REWORK
    assert not unexpected, "import cycles inside dtensor_fp8/: " + "; ".join(" <-> ".join(c) for c in sorted(unexpected))


def test_layers():
    wrong = []
    for name, deps in GRAPH.items():
        for dep in deps:
            if _layer_of(dep) > _layer_of(name):
                wrong.append(f"{name} ({LAYERS[_layer_of(name)][0]}) imports {dep} ({LAYERS[_layer_of(dep)][0]})")
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_nothing_imports_te():
    users = sorted(name for name, deps in GRAPH.items() if "te" in deps and not name.startswith("benchmarks"))
    assert not users, f"te.py plugs in from the top (it registers with fsdp.py); imported by {users}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_size(name):
    rel = str(MODULES[name].relative_to(PACKAGE))
    lines = len(MODULES[name].read_text().splitlines())
    if rel in OVERSIZE_PENDING_SPLIT:
        pytest.skip(f"{rel}: {lines} lines, split pending (OVERSIZE_PENDING_SPLIT)")
    assert lines <= MAX_LINES, f"dtensor_fp8/{rel} has {lines} lines (> {MAX_LINES}): split it into files of one concept each"


def test_private_torch_imports_only_in_compat():
    wrong = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(PACKAGE))
        if rel == "_compat.py":
            continue
        private = {m for m in imports_of(name)[1] if any(p.startswith("_") for p in m.split("."))}
        private -= ALLOWED_PRIVATE_TORCH | PRIVATE_TORCH_PENDING.get(rel, set())
        wrong += [f"{rel}: {m}" for m in sorted(private)]
    assert not wrong, "private torch modules outside _compat.py: " + "; ".join(wrong)


# ---- no call-stack introspection; the environment read in one place ---------------------------------
#: ``module.attribute`` reads that look at the call stack (frames and their locals): the package learns
#: about FSDP2 and torch from their objects (_compat.py), never from who called it.
FRAME_READS = {("sys", "_getframe"), ("sys", "_current_frames"), ("inspect", "currentframe"), ("inspect", "stack"),
               ("inspect", "getouterframes"), ("inspect", "getframeinfo"), ("traceback", "extract_stack")}
#: Attributes only a frame object has.
FRAME_ATTRIBUTES = {"f_locals", "f_back", "f_globals", "f_code", "f_lineno", "tb_frame"}
#: The one module that reads the process environment (the kernel / GEMM switches; benchmarks/ read
#: their own command-line flags and may read it too).
ENVIRONMENT_READER = "settings"
ENVIRONMENT_READS = {("os", "environ"), ("os", "getenv"), ("os", "putenv"), ("os", "unsetenv"), ("os", "environb")}


def _dotted_reads(tree: ast.AST) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``module.name`` attribute read and ``from module import name``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found.add((node.value.id, node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {(node.module, alias.name) for alias in node.names}
    return found


def frame_reads(source: str) -> list[str]:
    """What in ``source`` reads the call stack: ``sys._getframe`` & co., or a frame's attributes."""
    tree = ast.parse(source)
    dotted = sorted(f"{m}.{n}" for m, n in _dotted_reads(tree) & FRAME_READS)
    attrs = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRIBUTES})
    return dotted + attrs


def reads_environment(source: str) -> bool:
    return bool(_dotted_reads(ast.parse(source)) & ENVIRONMENT_READS)


def test_the_source_checks_see_what_they_look_for():
    assert frame_reads("import sys\nframe = sys._getframe(1)\nowner = frame.f_locals['self']") == ["sys._getframe", "f_locals"]
    assert frame_reads("from inspect import currentframe\nimport inspect\ninspect.stack()") == [
        "inspect.currentframe", "inspect.stack"]
    assert frame_reads('"""mentions sys._getframe in a docstring"""\nx = torch.stack([a])') == []
    assert reads_environment("import os\nos.environ.get('X')") and reads_environment("from os import getenv")
    assert not reads_environment("import os\nos.path.join('a', 'b')")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_call_stack_introspection(name):
    found = frame_reads(MODULES[name].read_text())
    assert not found, (f"dtensor_fp8/{MODULES[name].relative_to(PACKAGE)} reads the call stack ({', '.join(found)}): "
                       "learn what a hook needs from the objects it is given or from torch's own state (_compat.py)")


def test_one_module_reads_the_environment():
    readers = sorted(name for name, path in MODULES.items()
                     if not name.startswith("benchmarks") and reads_environment(path.read_text()))
    assert readers == [ENVIRONMENT_READER], (
        f"modules reading os.environ / os.getenv: {readers}; only dtensor_fp8/settings.py may (add a field to its "
        "Settings and read settings.current() instead)")


# ---- every collective names its process group ---------------------------------------------------------
#: torch.distributed functions that communicate (or read the group's size / rank), with the position of
#: their group argument when passed positionally. Under pipeline parallelism each stage runs different
#: code: a collective on the default (world) group inside a stage's work pairs it with another stage's,
#: or waits for one that never comes. The library derives every group from a weight's mesh (groups.py).
COLLECTIVES = {
    "all_reduce": 2, "all_gather": 2, "all_gather_object": 2, "all_gather_into_tensor": 2, "all_to_all": 2,
    "all_to_all_single": 4, "reduce_scatter": 3, "reduce_scatter_tensor": 3, "broadcast": 2, "broadcast_object_list": 2,
    "barrier": 0, "monitored_barrier": 0, "gather": 3, "gather_object": 3, "scatter": 3, "scatter_object_list": 3,
    "reduce": 3, "send": 2, "recv": 2, "isend": 2, "irecv": 2, "get_world_size": 0, "get_rank": 0,
    # torch.distributed._functional_collectives (funcol): the group is their third argument
    "all_gather_tensor": 2, "all_gather_single": 2, "all_reduce_coalesced": 2, "wait_tensor": None,
}
#: the names this module's readers bind torch.distributed (and its functional collectives) to
DIST_MODULES = {"torch.distributed", "torch.distributed._functional_collectives"}


def ungrouped_collectives(source: str) -> list[str]:
    """Calls of torch.distributed collectives in ``source`` that pass no process group (``group=``, or
    the positional slot), as ``"name:line"``."""
    tree = ast.parse(source)
    aliases, direct = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in DIST_MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES:
            direct |= {a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES}
            aliases |= {a.asname or a.name for a in node.names if a.name == "_functional_collectives"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, name = node.func, None
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            base = ast.unparse(f.value)
            if base in aliases or base in DIST_MODULES:
                name = f.attr
        elif isinstance(f, ast.Name) and f.id in direct:
            name = direct[f.id]
        if name is None or COLLECTIVES[name] is None:
            continue
        slot = COLLECTIVES[name]
        named = any(k.arg in ("group", "process_group", "pg") for k in node.keywords) or len(node.args) > slot
        if not named:
            found.append(f"{name}:{node.lineno}")
    return found


def test_the_collective_check_sees_what_it_looks_for():
    src = ("import torch.distributed as dist\nfrom torch.distributed import all_gather_object as ago\n"
           "import torch.distributed._functional_collectives as funcol\n"
           "dist.all_reduce(t, op=dist.ReduceOp.MAX)\ndist.all_reduce(t, dist.ReduceOp.MAX, g)\n"
           "dist.all_reduce(t, group=g)\nago(out, x)\ndist.get_world_size()\ndist.get_rank(g)\n"
           "funcol.all_gather_tensor(t, 0, g)\nfuncol.all_gather_tensor(t, 0)\nother.all_reduce(t)\n")
    assert ungrouped_collectives(src) == ["all_reduce:4", "all_gather_object:7", "get_world_size:8", "all_gather_tensor:11"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_collective_names_its_group(name):
    found = ungrouped_collectives(MODULES[name].read_text())
    assert not found, (f"dtensor_fp8/{MODULES[name].relative_to(PACKAGE)}: torch.distributed calls without a process "
                       f"group ({', '.join(found)}): pass the group derived from the weight's mesh (dtensor_fp8/groups.py), "
                       "or group=dist.group.WORLD where a whole-job command (a benchmark's main) means the world")


# ---- formats/: no module imports a module that imports it back -----------------------------------------
def _formats_imports(name: str) -> set[str]:
    """What formats module ``name`` imports, type-only imports (``if TYPE_CHECKING:``) included, and
    the kernel modules it imports by name at run time (``importlib.import_module(f"{__package__}.
    triton_{name}")``: every ``formats.triton_*`` module the f-string's constant prefix matches)."""
    deps = set(imports_of(name)[0])
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
                    deps.add(_ours(_package_parts(name) + stmt.module.split(".")))
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args and isinstance(node.args[0], ast.JoinedStr)):
            parts = node.args[0].values
            if (len(parts) >= 2 and isinstance(parts[0], ast.FormattedValue) and getattr(parts[0].value, "id", "") ==
                    "__package__" and isinstance(parts[1], ast.Constant)):
                prefix = ".".join(_package_parts(name)) + parts[1].value
                deps |= {m for m in MODULES if m.startswith(prefix) and m != name}
    return {d for d in deps if d in MODULES}


def test_no_formats_module_imports_a_module_that_imports_it_back():
    formats = {name for name in MODULES if name.startswith("formats.")}
    graph = {name: _formats_imports(name) if name in formats else GRAPH[name] for name in MODULES}
    assert "formats.triton_mxfp8" in graph["formats.triton_kernels"]  # the run-time import is read
    assert "formats.te_binding" in graph["formats.base"]  # and the type-only one
    found = sorted(c for c in _cycles(graph) if any(m in formats for m in c))
    assert not found, ("import cycles through formats/ (move what both sides need into a leaf module, as planes.py "
                       "and triton_switches.py are): " + "; ".join(" <-> ".join(c) for c in found))


_RECORD_IMPORTS = r'''
import builtins, importlib, json, sys
edges, real = set(), builtins.__import__
def record(name, globals=None, locals=None, fromlist=(), level=0):
    module = real(name, globals, locals, fromlist, level)
    importer = (globals or {}).get("__name__", "")
    if importer.startswith("dtensor_fp8.formats"):
        base = importlib.util.resolve_name("." * level + name, globals.get("__package__")) if level else name
        for target in [base] + [f"{base}.{f}" for f in (fromlist or ())]:
            if target in sys.modules and not hasattr(sys.modules[target], "__path__") and target != importer:
                edges.add((importer, target))
    return module
builtins.__import__ = record
real_import_module = importlib.import_module
def record_by_name(name, package=None):  # importlib.import_module: the caller is the importer
    module = real_import_module(name, package)
    importer = sys._getframe(1).f_globals.get("__name__", "")
    if importer.startswith("dtensor_fp8.formats") and module.__name__ != importer:
        edges.add((importer, module.__name__))
    return module
importlib.import_module = record_by_name
import dtensor_fp8
from dtensor_fp8.formats import triton_kernels
if triton_kernels._importable():
    for name in ("mxfp8", "blockwise", "per_tensor"):
        triton_kernels.kernels(name)
print(json.dumps(sorted(edges)))
'''


def test_formats_imports_at_run_time_have_no_cycle():
    """The same, as Python runs the imports (the Triton kernel modules too, where Triton is installed)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RECORD_IMPORTS], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={**__import__("os").environ, "PYTHONPATH": str(PACKAGE.parent)})
    graph: dict[str, set[str]] = {}
    for a, b in json.loads(out.stdout.strip().splitlines()[-1]):
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    assert graph, "no import of formats/ was recorded"
    found = sorted(_cycles(graph))
    assert not found, "formats/ imports that come back at run time: " + "; ".join(" <-> ".join(c) for c in found)


# ---- QuantizedTensor is storage (issue 38) ------------------------------------------------------------
#: What a ``QuantizedTensor`` instance may hold: its planes (the FP8 planes' inner tensors and the
#: high-precision values plane, ``hp_init``), recipe, usages, block phase (geometry: where a piece
#: starts inside its blocks) and the reference to its owner record. Its nominal dtype and shape are
#: the wrapper's own. Lifecycle (whether the bytes are pending, what a
#: cast reads through to, the transpose cache, scaling and gather state) is the owner's
#: (``param_state.py``), so no op making a new tensor can drop it.
QUANTIZED_TENSOR_FIELDS = {"rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "hp_init",
                           "_recipe", "_usages", "_phase", "_param_state"}
#: What torch itself sets on a tensor instance (``nn.Parameter`` of a tensor subclass marks it).
TORCH_INSTANCE_FIELDS = {"_is_param"}


def fields_beyond_storage(declared, instances) -> list[str]:
    """Fields a QuantizedTensor class declares (``declared``: its annotations) or its ``instances``
    hold beyond :data:`QUANTIZED_TENSOR_FIELDS`."""
    found = set(declared) | {name for t in instances for name in vars(t) if name not in TORCH_INSTANCE_FIELDS}
    return sorted(found - QUANTIZED_TENSOR_FIELDS)


def test_the_storage_check_sees_what_it_looks_for():
    class Grown:  # the fields QuantizedTensor had before issue 38
        pass

    g = Grown()
    g._transpose, g._cast_source, g._is_param = None, None, True
    assert fields_beyond_storage({"_recipe": "Recipe", "_bytes_pending": "bool"}, [g]) == [
        "_bytes_pending", "_cast_source", "_transpose"]
    assert fields_beyond_storage({"rowwise_data": "Tensor", "_param_state": "FP8ParamState"}, []) == []


def test_quantized_tensor_holds_storage_only():
    import torch
    import torch.nn.functional as F

    import dtensor_fp8 as d
    from dtensor_fp8.module import fp8_parameter_values

    instances = []
    for recipe in (d.CurrentScaling(), d.MXFP8()):
        q = d.quantize(torch.randn(128, 128), recipe)
        q.create_transpose_cache()
        x = torch.randn(4, 128, requires_grad=True)
        F.linear(x, q).sum().backward()  # the GEMMs, their transpose cache
        instances += [q, q.detach(), q.to(torch.bfloat16), q.t().t(), q[:64], torch.nn.Parameter(q), q.clone(),
                      fp8_parameter_values(torch.randn(128, 128), recipe)]
        pending = fp8_parameter_values(torch.empty(128, 128, device="meta"), recipe)
        instances += [pending, pending.new_zeros((256, 128)), torch.empty_like(pending, device="cpu")]
    assert not fields_beyond_storage(d.QuantizedTensor.__annotations__, instances), (
        "QuantizedTensor holds more than its storage: "
        f"{fields_beyond_storage(d.QuantizedTensor.__annotations__, instances)}. Keep lifecycle state (pending "
        "bytes, casts, caches, per-gather or scaling state) in its owner record, FP8ParamState (param_state.py), "
        "where every tensor derived from the parameter finds it")


# ---- an FP8 weight's lifecycle is written by its owner only ----------------------------------------------
#: the attributes holding an FP8 weight's lifecycle (``dtensor_fp8/lifecycle.py``) and the flags they
#: replaced: only ``lifecycle.py`` assigns them, through its transition methods
LIFECYCLE_FIELDS = {"lifecycle", "_bytes_state", "_loaded_since_step", "bytes_state", "loaded_since_step",
                    "bytes_pending", "init_written", "bytes_loaded", "master_loaded"}
LIFECYCLE_OWNER = PACKAGE / "lifecycle.py"


def lifecycle_writes(source: str) -> list[str]:
    """Assignments (plain, augmented, annotated, ``setattr`` / ``object.__setattr__`` with the name
    spelled out) to an attribute in :data:`LIFECYCLE_FIELDS` in ``source``, as ``"name:line"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in LIFECYCLE_FIELDS:
            found.append((node.lineno, node.col_offset, node.args[1].value))
        for target in targets:
            for t in ast.walk(target):  # a, b.x = ... and (b.x, c.y) = ...
                if isinstance(t, ast.Attribute) and t.attr in LIFECYCLE_FIELDS and isinstance(t.ctx, ast.Store):
                    found.append((t.lineno, t.col_offset, t.attr))
    return [f"{name}:{line}" for line, _, name in sorted(found)]


def test_the_lifecycle_check_sees_what_it_looks_for():
    src = ("q.param_state.init_written = True\nr.bytes_loaded = r.master_loaded = False\nsetattr(r, 'bytes_pending', 1)\n"
           "r.lifecycle._bytes_state: object = None\nok = q.bytes_pending and r.lifecycle.bytes_state\n"
           "r.lifecycle.mark_made()\nstate['lifecycle'] = x\nr._loaded_since_step |= 1\n")
    assert lifecycle_writes(src) == ["init_written:1", "bytes_loaded:2", "master_loaded:2", "bytes_pending:3",
                                     "_bytes_state:4", "_loaded_since_step:8"]


def _lifecycle_checked_files() -> list[Path]:
    root = PACKAGE.parent
    return [p for folder in ("dtensor_fp8", "tests", "examples") for p in sorted((root / folder).rglob("*.py"))
            if p != LIFECYCLE_OWNER]


def test_only_the_owner_writes_the_lifecycle():
    files = _lifecycle_checked_files()
    assert len(files) > len(MODULES)  # the package, the tests and the examples are read
    writes = {str(p.relative_to(PACKAGE.parent)): found for p in files if (found := lifecycle_writes(p.read_text()))}
    assert not writes, (
        f"an FP8 weight's lifecycle is written outside dtensor_fp8/lifecycle.py: {writes}. Call the transition of "
        "record.lifecycle (Lifecycle.mark_to_empty, mark_init_written, mark_made, mark_bytes_loaded, ...) instead; "
        "a new transition belongs in lifecycle.py, with the states it starts from")
