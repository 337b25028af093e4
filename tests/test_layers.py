"""The package's layers point down only (ARCHITECTURE.md): options, config and wrap import neither
Lightning nor the rest of the package; the engine imports no Lightning and nothing above it; the
memory plan checks its arguments without a strategy. Imports inside functions count: they tie two
files together as much as those at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_strategy"
LAYERS = [  # bottom first: a module may import its own layer and those below
    ("options", ("options", "config", "wrap")),
    ("engine", ("engine",)),
    ("services", ("checkpoint", "plan", "distributed")),
]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _top(name: str) -> str | None:
    """The package's first-level module an import names (``fsdp_strategy.engine.unit`` -> ``engine``)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "fsdp_strategy" and len(parts) > 1 else None


def _files(names: tuple[str, ...]) -> list[Path]:
    single = [PACKAGE / f"{n}.py" for n in names if (PACKAGE / f"{n}.py").exists()]
    return single + [path for n in names if (PACKAGE / n).is_dir() for path in (PACKAGE / n).rglob("*.py")]


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_a_layer_imports_only_its_own_and_lower_layers(layer):
    allowed = {module for _, modules in LAYERS[: layer + 1] for module in modules}
    wrong = []
    for path in _files(LAYERS[layer][1]):
        for name in _imports(path):
            top = _top(name)
            is_module = top is not None and ((PACKAGE / top).is_dir() or (PACKAGE / f"{top}.py").exists())
            if is_module and top not in allowed:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
            if layer < 2 and name.split(".")[0] in ("lightning", "lightning_utilities", "pytorch_lightning"):
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {name} (no Lightning below the services)")
    assert not wrong, wrong


ENGINE = PACKAGE / "engine"
# The training step's data plane: what moves and holds a unit's bytes. It reports to the observer
# interface collectives.py defines; the observer's implementation, the watchdog and the blocking
# control plane sit above it, so no import path leads from here to them.
DATA_PLANE = ("collectives", "exchange", "buffers", "unit", "reductions", "param", "flat", "state", "device", "edits")
ABOVE_DATA_PLANE = ("watchdog", "monitoring", "control")


def _engine_imports(module: str) -> set[str]:
    """The engine modules ``module`` imports (``from fsdp_strategy.engine import x`` included)."""
    found = set()
    for name in _imports(ENGINE / f"{module}.py"):
        parts = name.split(".")
        if parts[:2] == ["fsdp_strategy", "engine"] and len(parts) > 2 and (ENGINE / f"{parts[2]}.py").exists():
            found.add(parts[2])
    return found


def _import_path(start: str, targets: tuple[str, ...]) -> list[str] | None:
    """The first import path from engine module ``start`` to one of ``targets`` (None: none leads there)."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for module in sorted(_engine_imports(path[-1])):
            if module in targets:
                return [*path, module]
            if module not in seen:
                seen.add(module)
                paths.append([*path, module])
    return None


def test_no_import_path_leads_from_the_data_plane_to_the_watchdog():
    found = {module: _import_path(module, ABOVE_DATA_PLANE) for module in DATA_PLANE}
    assert {module: " -> ".join(path) for module, path in found.items() if path} == {}


def test_the_import_path_check_sees_a_path():
    assert _import_path("control", ("watchdog",)) == ["control", "watchdog"]
    assert _import_path("__init__", ("flight",)) is not None
