"""Sizing is the decoding loop's component, not the policies': ``policies/`` imports nothing of ``cost/`` (no speed
model, no cost curve, no sizer), and `TreePolicy` has no method that exists only for sizing."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_treespec
from hf_treespec.policies import TreePolicy

POLICIES_DIR = Path(hf_treespec.__file__).parent / "policies"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved inside hf_treespec.policies)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ["hf_treespec", "policies"][: max(0, 2 - (node.level - 1))] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_policies_import_no_cost_model():
    offenders = {path.name: sorted(m for m in imported_modules(path) if m.startswith("hf_treespec.cost"))
                 for path in sorted(POLICIES_DIR.glob("*.py"))}
    offenders = {name: modules for name, modules in offenders.items() if modules}
    assert not offenders, f"policies import the cost model: {offenders}"


def test_the_scan_resolves_relative_imports(tmp_path):
    source = tmp_path / "p.py"
    source.write_text("from ..cost.speed_model import SpeedModel\nfrom .base import TreePolicy\nimport torch\n")
    found = imported_modules(source)
    assert "hf_treespec.cost.speed_model" in found and "hf_treespec.policies.base" in found and "torch" in found


def test_tree_policy_has_no_sizing_methods():
    sizing_words = ("may_draft", "wants_timing", "sizer", "speed", "auto_sized", "budget_for")
    members = [name for name in dir(TreePolicy) if not name.startswith("__")]
    assert not [name for name in members if any(word in name for word in sizing_words)]
