"""The package's import layering, read from the source (no import runs), plus one check that runs the imports.

The floors run errors -> geometry -> partition / groups -> primitives / kernels -> fused -> layers -> tune /
interop and the entry points; a module may import its own floor or lower ones, never a higher one.  The geometry
layer imports no ``torch.distributed`` at all, so it stays a pure function of shapes, and kernels never import
primitives.  Imports inside functions count too: a lazy import upward is still a cycle waiting to happen.

No import circle either: the graph of module -> module imports (lazy and ``TYPE_CHECKING`` ones included, and the
package ``__init__`` that importing ``distfuse.pkg.mod`` from outside ``pkg`` runs) has no strongly connected
component beyond :data:`ALLOWED_CYCLES`, each named module by module, so a new circle fails, and so does a module
joining the allowed one.

``python tests/test_layering.py`` prints the graph's upward arrows and circles.
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "distfuse"

# The floor of each top-level module or package of distfuse; "__init__" is the package itself.
FLOOR = {
    "errors": 0, "_compat": 0,
    "geometry": 1,
    "partition": 2, "groups": 2, "timing": 2,
    # the debug checks' call counters are per world (groups.WorldTable)
    "debug": 3,
    "kernels": 3, "primitives": 3, "testing": 3,
    # fused/ holds the registry of fused ops and the crossover table's reader (fused/crossover_table.py) that
    # dispatch and the providers read; the tuner writes the table and imports the reader from there
    "fused": 4,
    # torch.library custom ops over the primitives (and the fused ops); the layers call them in compiled code
    "ops": 4,
    "layers": 5,
    # bridges to DeviceMesh/DTensor/DCP and the whole-model helpers sit beside the tuner, above the layers;
    # the DeviceMesh conversion is interop's (device_mesh_of, partition_from_device_mesh), not a Partition method
    "tune": 6, "interop": 6, "model": 6,
    "demo": 7, "demo_check": 7, "demo_unet": 7, "demo_gpt": 7, "__init__": 7,
}

ALLOWED_CYCLES: set[frozenset[str]] = set()  # none left: every import circle is a failure


def _modules() -> dict[str, pathlib.Path]:
    """``{"distfuse.fused.registry": path, "distfuse.fused": .../fused/__init__.py, "distfuse": ...}``."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str:
    """The module ``name`` loads: itself if it is one, else the package or module that defines it."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _packages(name: str) -> list[str]:
    """The packages above ``name`` (``distfuse.a.b`` -> ``distfuse.a``, ``distfuse``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def imports_of(module: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every distfuse import of ``module``, lazy and ``TYPE_CHECKING`` ones included.

    ``from distfuse.pkg import name`` imports ``distfuse.pkg.name`` when that is a module, else ``distfuse.pkg``
    (its ``__init__``).  A bare ``import distfuse`` (for ``__version__``) adds nothing: the package has run
    before any of its modules; ``from distfuse import Partition`` does import the package's ``__init__``.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name != "distfuse"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out += [(_owner(n), node.lineno) for n in names if n.split(".")[0] == "distfuse"]
    return out


@functools.cache
def graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}``, with the package ``__init__`` files an import runs.

    Importing ``distfuse.tune.table`` from outside ``tune`` first runs ``distfuse/tune/__init__.py`` (and
    whatever that imports); the packages above the importer itself have run already.
    """
    edges = {}
    for module in MODULES:
        mine = set(_packages(module))
        out = edges[module] = {}
        for target, line in imports_of(module):
            for t in [target, *_packages(target)]:
                if t != module and t not in mine:
                    out.setdefault(t, line)
    return edges


def floor_of(module: str) -> tuple[str, int | None]:
    """``(top-level name, floor)``; the package itself is ``"__init__"``; None for a name not in :data:`FLOOR`."""
    top = module.split(".")[1] if "." in module else "__init__"
    return top, FLOOR.get(top)


def upward_arrows(module: str) -> list[str]:
    """``module``'s imports of a higher floor, one line each (the modules it names; ``distfuse`` is the package's
    ``__init__``, floor 7)."""
    top, floor = floor_of(module)
    out = {}
    for target, line in sorted(imports_of(module), key=lambda t: t[1]):
        ttop, tfloor = floor_of(target)
        if ttop != top and tfloor > floor:
            out.setdefault(target, f"{MODULES[module].relative_to(ROOT.parent)}:{line} imports {target} "
                                   f"(floor {tfloor}) from floor {floor}")
    return sorted(out.values())


def cycles(edges) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def _describe(comp, edges) -> str:
    return "\n".join(f"  {a} -> {b} (line {edges[a][b]})" for a in sorted(comp) for b in sorted(edges[a])
                     if b in comp)


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: str(MODULES[m].relative_to(ROOT)))
def test_no_module_imports_a_higher_floor(module):
    for m in (module, *(t for t, _ in imports_of(module))):
        assert floor_of(m)[1] is not None, f"{m}: its top level is not in tests/test_layering.py's FLOOR table"
    arrows = upward_arrows(module)
    assert not arrows, "\n".join(arrows)


def test_no_import_circle_but_the_allowed_one():
    edges = graph()
    found = cycles(edges)
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "import circle(s) in distfuse/:\n" + "\n\n".join(_describe(c, edges) for c in new)


def test_importing_the_layers_loads_neither_the_tuner_nor_interop():
    code = ("import sys, distfuse.partition; assert not [m for m in sys.modules if m.startswith('distfuse.interop')]; "
            "import distfuse.layers; print(sorted(m for m in sys.modules "
            "if m.startswith(('distfuse.tune', 'distfuse.interop', 'distfuse.model'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_kernels_never_import_primitives_and_geometry_is_pure():
    for module, path in MODULES.items():
        rel = path.relative_to(ROOT)
        targets = {floor_of(t)[0] for t, _ in imports_of(module)}
        if rel.parts[0] == "kernels":
            upward = targets & {"primitives", "partition", "fused", "layers"}
            assert not upward, (rel, targets)
        if rel.parts[0] == "geometry":
            assert targets <= {"errors", "geometry"}, (rel, targets)
            tree = ast.parse(path.read_text())
            every = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            every |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not {m for m in every if m.startswith("torch.distributed")}, (rel, every)
            top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
            top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
            assert not {m for m in top if m and m.split(".")[0] == "torch"}, (rel, top)


def test_errors_module_imports_torch_distributed_only_lazily():
    tree = ast.parse((ROOT / "errors.py").read_text())
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.startswith("torch") for m in top), top


if __name__ == "__main__":
    edges = graph()
    up, found = [a for m in sorted(MODULES) for a in upward_arrows(m)], cycles(edges)
    print(f"{len(MODULES)} modules, {sum(map(len, edges.values()))} imports; {len(up)} upward, {len(found)} circles")
    print("\n".join(up)) if up else None
    for comp in found:
        print(("allowed" if comp in ALLOWED_CYCLES else "NEW") + " circle:\n" + _describe(comp, edges))
