"""The device seam, read from the source (no module is run): the loader and the runner hold no
device branch beyond asking the backend (engine/backend.py), and what the backend decides
reaches the model, its layers and the runner through their constructors or `wire` methods,
never through an attribute set from outside."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEAM_FREE = [ROOT / "appliance/engine/loader.py", ROOT / "appliance/engine/model_runner.py"]
# Attributes that carry a backend's decisions: each set by its owner's constructor or `wire`.
WIRED = {"matmul", "kv_path", "ops", "quant_out_dtype", "guided", "samples", "hooks"}


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text("utf-8"), str(path))


def device_branches(tree: ast.AST) -> list[str]:
    """isinstance calls, device names as strings, and reads of a device's `.type`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            found.append(f"line {node.lineno}: isinstance")
        elif isinstance(node, ast.Constant) and node.value in ("cuda", "cpu"):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "type":
            found.append(f"line {node.lineno}: .type")
    return found


def outside_sets(tree: ast.AST) -> list[str]:
    """Assignments `x.attr = ...` to a wired attribute where x is not `self`."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr in WIRED
                and not (isinstance(target.value, ast.Name) and target.value.id == "self")
            ):
                found.append(f"line {node.lineno}: .{target.attr}")
    return found


def test_the_checks_see_what_they_forbid() -> None:
    sample = ast.parse(
        "if isinstance(m, X) or device.type == 'cuda':\n    layer.matmul = m\nself.ops = o\n"
    )
    assert device_branches(sample) == ["line 1: isinstance", "line 1: .type", "line 1: 'cuda'"]
    assert outside_sets(sample) == ["line 2: .matmul"]


def test_loader_and_runner_hold_no_device_branch() -> None:
    found = {p.name: device_branches(_tree(p)) for p in SEAM_FREE}
    assert {name: f for name, f in found.items() if f} == {}


def test_no_wired_attribute_is_set_from_outside() -> None:
    files = [
        *ROOT.glob("appliance/**/*.py"),
        *ROOT.glob("kernels/*.py"),
        *ROOT.glob("console/*.py"),
    ]
    found = {str(p.relative_to(ROOT)): outside_sets(_tree(p)) for p in files}
    assert {name: f for name, f in found.items() if f} == {}
