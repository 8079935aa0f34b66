"""The package's import layering, read from the source (no import runs).

The floors run errors -> geometry -> partition -> primitives / kernels -> fused -> layers -> tune and the
entry points; a module may import its own floor or lower ones, never a higher one.  The geometry layer imports
no ``torch.distributed`` at all, so it stays a pure function of shapes, and kernels never import primitives.
Imports inside functions count too: a lazy import upward is still a cycle waiting to happen.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "distfuse"

FLOOR = {
    "errors": 0, "_compat": 0, "debug": 0,
    "geometry": 1,
    "partition": 2, "groups": 2, "timing": 2,
    "kernels": 3, "primitives": 3, "testing": 3,
    "fused": 4,
    # torch.library custom ops over the primitives (and the fused ops); the layers call them in compiled code
    "ops": 4,
    "layers": 5,
    "tune": 6, "demo": 7, "demo_unet": 7, "__init__": 7,
    # the crossover table's format sits beside the registry it keys: dispatch reads it, the sweep writes it
    "tune.table": 4,
    # bridges to DeviceMesh/DTensor/DCP and the whole-model helpers sit beside the tuner, above the layers;
    # the DeviceMesh conversion needs only partitions, so Partition.device_mesh() may delegate to it
    "interop": 6, "model": 6, "interop.device_mesh": 2,
}

def _floor_of(rel: pathlib.Path) -> str:
    parts = rel.parts
    if len(parts) == 1:
        return rel.stem
    sub = f"{parts[0]}.{rel.stem}"
    return sub if sub in FLOOR else parts[0]


def _distfuse_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """``(first component after distfuse, line)`` of every distfuse import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "distfuse":
                names = [f"distfuse.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "distfuse" and len(parts) > 1:
                sub = ".".join(parts[1:3])
                out.append((sub if sub in FLOOR else parts[1], node.lineno))
    return out


def _modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_floor(path):
    rel = path.relative_to(ROOT)
    mine = _floor_of(rel)
    assert mine in FLOOR, f"{rel}: floor {mine!r} is not in tests/test_layering.py's FLOOR table"
    for target, line in _distfuse_imports(path):
        if target not in FLOOR:  # a module of the top-level package (distfuse.<module>)
            continue
        assert FLOOR[target] <= FLOOR[mine] or target.split(".")[0] == mine.split(".")[0], (
            f"distfuse/{rel}:{line} imports distfuse.{target} (floor {FLOOR[target]}) from floor {FLOOR[mine]}")


def test_kernels_never_import_primitives_and_geometry_is_pure():
    for path in _modules():
        rel = path.relative_to(ROOT)
        targets = {t for t, _ in _distfuse_imports(path)}
        if rel.parts[0] == "kernels":
            upward = {t.split(".")[0] for t in targets} & {"primitives", "partition", "fused", "layers"}
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
