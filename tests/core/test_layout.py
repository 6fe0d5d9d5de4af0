"""The house's rules, checked: no import cycles among tilegemm's modules, the registry imports nothing above
it, every family registers itself, and every registered kernel and adapter resolves."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import tilegemm
from tilegemm.core import registry
from tilegemm.core.runtime import interpreting
from tilegemm.ops import FAMILIES

PACKAGE = Path(tilegemm.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tilegemm modules ``name`` imports anywhere in its body (function-level imports included)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    out.add(target)
                elif source in modules:
                    out.add(source)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """The checker itself: two modules importing each other (one inside a function) form a cycle."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert _imports("a", modules["a"], modules) == {"b"} and _imports("b", modules["b"], modules) == {"a"}


def test_core_imports_nothing_above_it():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("tilegemm.core"):
            above = {d for d in deps if not d.startswith("tilegemm.core")}
            assert not above, f"{name} imports {sorted(above)}: core must not import the layers above it"
    assert graph["tilegemm.core.registry"] <= {"tilegemm.core.runtime"}


def test_every_family_registers_an_op_with_a_bench_adapter():
    for family in FAMILIES:
        module = importlib.import_module(f"tilegemm.ops.{family}")
        assert module.__name__ == f"tilegemm.ops.{family}"
    assert set(registry.ops()) >= {"matmul", "copy", "grey"}
    for op in registry.ops():
        spec = registry.op(op)
        assert spec.bench is not None, f"op {op} has no bench adapter"
        assert spec.bench_adapter()().name == op


@pytest.mark.parametrize("op", registry.ops())
def test_every_registered_kernel_resolves(op):
    for spec in registry.specs(op):
        module_name, _, attr = spec.target.partition(":")
        assert callable(getattr(importlib.import_module(module_name), attr)), spec.target
    if registry.op(op).tune:
        assert callable(registry.resolve(registry.op(op).tune))


# Cross-family imports that predate the entry points, to go as those families move to them: none left (conv2d's
# 1x1 and gradient paths and its reference moved to tilegemm.ops.matmul's make_problems and launch).
_LEGACY_CROSS_FAMILY: set = set()


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["tilegemm", "ops"] else None


def test_families_meet_through_their_packages_only():
    """A family imports another family's package (its public function and documented entry points, such as
    ``tilegemm.ops.matmul.make_problems`` and ``launch``), never one of its modules; and no family imports
    ``core`` back through another's."""
    crossing = set()
    for name, deps in _graph().items():
        mine = _family(name)
        if mine is None:
            continue
        for dep in deps:
            theirs = _family(dep)
            if theirs is not None and theirs != mine and dep != f"tilegemm.ops.{theirs}":
                crossing.add((name, dep))
    assert crossing <= _LEGACY_CROSS_FAMILY, f"private cross-family imports: {sorted(crossing - _LEGACY_CROSS_FAMILY)}"


def test_matmuls_entry_points_are_names_of_its_package():
    """The matmul entry points other families call are names of the package (tests/core/test_import.py checks
    that importing it imports no kernel module and no triton)."""
    import tilegemm.ops.matmul as matmul

    assert callable(matmul.make_problems) and callable(matmul.launch)
    assert matmul.make_problems.__module__ == "tilegemm.ops.matmul.problem"
    assert matmul.launch.__module__ == "tilegemm.ops.matmul.dispatch"


@pytest.mark.skipif(not interpreting(), reason="the route is read with CPU tensors under the interpreter; on a GPU "
                    "`tools/gpu_cycle.sh route` reads it")
def test_a_matmul_call_runs_downward_through_few_files():
    """The route of one ``tilegemm.matmul`` call (tools/call_route.py): the files on the stack at its launch
    are at most 8, the files whose code runs at all (fp16 under the interpreter) at most 8, and no function of ``core/`` calls back
    into a family."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    try:
        import call_route
    finally:
        sys.path.pop(0)
    call_route._import_everything()
    a, b = torch.randn(17, 33).half(), torch.randn(33, 65).half()
    r = call_route.route(lambda: tilegemm.matmul(a, b))
    assert r["route"][0] == "ops/matmul/api.py" and r["route"][-1] == "core/launch.py", r["route"]
    assert r["route_count"] <= 8, r["route"]
    assert r["count"] <= 8, r["files"]
    assert r["downward"], r["upward_calls"]
    assert not r["imports_run"], r["imports_run"]
