"""The trainers use the runtime through one small public API, ``hf_treespec.api``, and nothing else of it.

Every ``import`` of ``trainers/**/*.py`` (at module level or inside a function) that reaches the inference package
must be ``from hf_treespec.api import ...``; a relative import may not leave ``hf_treespec.trainers``. The API lists
exactly the names the trainers use: one it exports that no trainer imports is dead weight, to be removed from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_treespec.api

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ROOT / "trainers"
API = "hf_treespec.api"


def runtime_imports() -> list[tuple[str, str, list[str]]]:
    """``(file:line, module, names)`` of every import of the inference package in the trainers."""
    found = []
    for path in sorted(TRAINERS.rglob("*.py")):
        # the file's package as a module path, e.g. hf_treespec.trainers.data for trainers/data/x.py
        package = ["hf_treespec", "trainers", *path.relative_to(TRAINERS).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(TRAINERS.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [(where, alias.name, []) for alias in node.names
                          if alias.name.split(".")[0] == "hf_treespec"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                inside_trainers = module == "hf_treespec.trainers" or module.startswith("hf_treespec.trainers.")
                if module.split(".")[0] == "hf_treespec" and not inside_trainers:
                    found.append((where, module, [alias.name for alias in node.names]))
    return found


def test_trainers_import_the_runtime_only_through_its_public_api():
    imports = runtime_imports()
    assert imports, "the scan found no import of the runtime: is the pattern broken?"
    wrong = [f"{where}: {module}" for where, module, _ in imports if module != API]
    assert not wrong, f"trainers import runtime internals; add the names to {API} and import them from there:\n" + \
        "\n".join(wrong)


def test_the_api_exports_exactly_what_the_trainers_use():
    used = {name for _, module, names in runtime_imports() if module == API for name in names}
    exported = set(hf_treespec.api.__all__)
    assert len(hf_treespec.api.__all__) == len(exported), "a name is listed twice in __all__"
    assert used <= exported, f"imported but not exported: {sorted(used - exported)}"
    assert exported <= used, f"exported but no trainer uses it: {sorted(exported - used)}"
    assert all(hasattr(hf_treespec.api, name) for name in exported)


def test_the_scan_catches_an_internal_import(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.py").write_text("def f():\n    from hf_treespec.kv.tree_kv import keep_rows\n"
                                             "from ... import tree\nfrom ..objectives import losses\n")
    monkeypatch.setattr(__import__(__name__), "TRAINERS", tmp_path)
    assert sorted((module, names) for _, module, names in runtime_imports()) == [
        ("hf_treespec", ["tree"]), ("hf_treespec.kv.tree_kv", ["keep_rows"])]
