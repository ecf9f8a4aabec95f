"""The tests folder's layout: shared helpers live in tests/support/; no test imports scripts/ or
another test module, and none loads a script by its path."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS.parent / "scripts"
# ways to run a file by its path instead of importing a module
LOADERS = {"spec_from_file_location", "SourceFileLoader", "run_path", "load_source"}


def _sources() -> list[Path]:
    return sorted(TESTS.glob("*.py")) + sorted((TESTS / "support").glob("*.py"))


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            names.append(node.args[0].value)  # importlib.import_module("name")
    return names


def _loads_a_script(tree: ast.AST) -> bool:
    """A call to a path loader in a file that names the scripts folder in a string."""
    calls = any(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) in LOADERS
                                             or getattr(n.func, "id", None) in LOADERS)
                for n in ast.walk(tree))
    strings = [n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return calls and any(s == "scripts" or "scripts/" in s for s in strings)


def test_tests_import_neither_scripts_nor_other_tests():
    script_modules = {p.stem for p in SCRIPTS.glob("*.py")}
    bad = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for name in _imported(tree):
            top = name.split(".")[0]
            if top.startswith("test_") or top == "scripts" or top in script_modules:
                bad.append(f"{path.relative_to(TESTS)} imports {name}")
        if _loads_a_script(tree):
            bad.append(f"{path.relative_to(TESTS)} loads a file from scripts/ by its path")
    assert not bad, "move shared helpers into tests/support/:\n" + "\n".join(bad)
