"""Every ``tree_policy=`` call in the tests pins its tree size, unless its test is marked as testing ``auto``.

``tree_budget="auto"`` sizes trees by this machine's measured costs, so which steps draft depends on the machine,
its load and what ran before: a test of identity, a sampled law or draft counts that leaves the size to ``auto``
may pass without drafting a tree. A call pins its size by passing ``tree_budget`` (a number), by ``**fixed_budget(
policy)``, by naming (as a literal) a policy whose default size is a number, or (the trainers' ``PrepareConfig``,
whose policy takes its parameters as a dict) by a literal ``tree_params`` dict with a ``"tree_budget"`` key. Tests
of ``auto`` itself carry ``@pytest.mark.auto_budget``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hf_treespec.policies import POLICIES

TESTS = Path(__file__).parent


def auto_by_default() -> set[str]:
    return {name for name in POLICIES.names() if POLICIES.get(name).defaults.get("tree_budget") == "auto"}


def _marked_auto(function: ast.AST) -> bool:
    for decorator in getattr(function, "decorator_list", []):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "auto_budget":
            return True
    return False


def _pins(call: ast.Call, auto_policies: set[str]) -> str | None:
    """None when ``call`` pins its tree size, else why not."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    budget = keywords.get("tree_budget")
    if budget is not None:
        if isinstance(budget, ast.Constant) and budget.value == "auto":
            return "tree_budget='auto' outside a test marked auto_budget"
        return None
    params = keywords.get("tree_params")
    if isinstance(params, ast.Dict) and any(isinstance(key, ast.Constant) and key.value == "tree_budget"
                                            for key in params.keys):
        if any(isinstance(key, ast.Constant) and key.value == "tree_budget" and isinstance(value, ast.Constant)
               and value.value == "auto" for key, value in zip(params.keys, params.values)):
            return "tree_budget='auto' outside a test marked auto_budget"
        return None
    for splat in (k.value for k in call.keywords if k.arg is None):
        if isinstance(splat, ast.Call) and getattr(splat.func, "id", None) == "fixed_budget":
            return None
    policy = keywords["tree_policy"]
    if isinstance(policy, ast.Constant) and policy.value not in auto_policies:
        return None
    return "no tree_budget (the policy may default to 'auto')"


def unpinned_calls(path: Path, auto_policies: set[str]) -> list[str]:
    """``file:line: reason`` for every call in ``path`` with a ``tree_policy`` keyword that pins no size, outside
    functions marked ``auto_budget``."""
    found = []

    def visit(node: ast.AST, marked: bool) -> None:
        marked = marked or _marked_auto(node)
        if isinstance(node, ast.Call) and any(k.arg == "tree_policy" for k in node.keywords) and not marked:
            reason = _pins(node, auto_policies)
            if reason:
                found.append(f"{path.name}:{node.lineno}: {reason}")
        for child in ast.iter_child_nodes(node):
            visit(child, marked)

    visit(ast.parse(path.read_text()), False)
    return found


def test_every_tree_policy_call_pins_its_size():
    auto_policies = auto_by_default()
    assert {"salf", "optimal", "eagle2"} <= auto_policies
    found = [line for path in sorted(TESTS.glob("*.py")) for line in unpinned_calls(path, auto_policies)]
    assert not found, "tree_policy calls that leave the tree size to the machine:\n" + "\n".join(found)


def test_the_check_sees_an_unpinned_call(tmp_path):
    """The scan finds what it must (a mutation check of the rule itself)."""
    source = tmp_path / "test_example.py"
    source.write_text(
        "import pytest\n"
        "def test_a(m, policy):\n"
        "    m.generate(tree_policy=policy)\n"  # 3: unknown policy, no budget
        "    m.generate(tree_policy='salf')\n"  # 4: auto by default
        "    m.generate(tree_policy='salf', tree_budget='auto')\n"  # 5: auto, unmarked
        "    m.generate(tree_policy='salf', tree_budget=8)\n"
        "    m.generate(tree_policy=policy, **fixed_budget(policy))\n"
        "    m.generate(tree_policy='chain')\n"
        "    PrepareConfig(tree_policy='salf', tree_params={'tree_depth': 2})\n"  # 9: auto by default
        "    PrepareConfig(tree_policy='salf', tree_params={'tree_budget': 'auto'})\n"  # 10: auto, unmarked
        "    PrepareConfig(tree_policy='salf', tree_params={'tree_budget': 60})\n"
        "@pytest.mark.auto_budget\n"
        "def test_b(m):\n"
        "    m.generate(tree_policy='salf')\n"
    )
    found = unpinned_calls(source, {"salf"})
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "9", "10"]
