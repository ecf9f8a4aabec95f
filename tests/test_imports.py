"""The package's layering: imports point one way, there is no import cycle, only the CLI prints,
and `import dflash_mlx` loads no model code.

The direction: front-ends (`cli/ server/ tui/ bench/ train/`) → `engine` → `generate` →
`speculate/` → `models/`. No front-end imports the CLI; the CLI imports the server and the TUI
only inside the commands that launch them.

Read from the source with `ast`, so every import counts, the lazy ones inside functions too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_mlx", "tui")

# Lower layers never import higher ones. Within a layer anything goes, but no cycles.
LAYERS = [
    ("dflash_mlx", "dflash_mlx.errors", "dflash_mlx.cpu", "dflash_mlx.cpu.blas",
     "dflash_mlx.cpu.policy"),
    # networks, formats, and the speculation core's pure parts
    ("dflash_mlx.models", "dflash_mlx.gguf", "dflash_mlx.inputs", "dflash_mlx.speculate.sampling",
     "dflash_mlx.speculate.grammar", "dflash_mlx.speculate.processors",
     "dflash_mlx.speculate.tree", "dflash_mlx.speculate.lookup", "dflash_mlx.speculate.guards",
     "dflash_mlx.speculate.config", "dflash_mlx.speculate.proposal",
     "dflash_mlx.speculate.width"),
    ("dflash_mlx.speculate", "dflash_mlx.loader", "dflash_mlx.tiny", "dflash_mlx.demo",
     "dflash_mlx.machine", "dflash_mlx.distributed"),
    ("dflash_mlx.generate", "dflash_mlx.batch", "dflash_mlx.batch_prefill"),
    ("dflash_mlx.stats", "dflash_mlx.chat", "dflash_mlx.registry", "dflash_mlx.cpu.cost",
     "dflash_mlx.cpu.tree_budget"),
    ("dflash_mlx.engine",),  # the one assembly every front-end opens a pair through
    ("dflash_mlx.bench", "dflash_mlx.train", "dflash_mlx.server"),
    # the user-facing layer: commands, the trainer's command code, the TUI
    ("dflash_mlx.cli", "dflash_mlx.train.cli", "tui"),
]
# The one upward import, and why: the package's first lines arm the CLI's Ctrl-C guard when the
# `dflash-mlx` command imports it (cli/signals.py imports nothing of the package).
ALLOWED_UPWARD = {("dflash_mlx", "dflash_mlx.cli.signals")}
# Modules that may print (write to the terminal): the command line and the TUI only.
SPEAKERS = ("dflash_mlx.cli", "dflash_mlx.train.cli", "tui")
FRONT_ENDS = ("dflash_mlx.cli", "dflash_mlx.server", "dflash_mlx.bench", "dflash_mlx.train", "tui")
CORE = ("dflash_mlx.engine", "dflash_mlx.generate", "dflash_mlx.speculate", "dflash_mlx.models")
# (modules, what they must not import, why), lazy imports included
DIRECTION = [
    (("dflash_mlx.server", "tui"), ("dflash_mlx.cli",), "a front-end imports no other"),
    (CORE, FRONT_ENDS, "the engine and what it runs serve the front-ends"),
    (("dflash_mlx.speculate",), ("dflash_mlx.generate", "dflash_mlx.engine", "dflash_mlx.cli",
                                 "dflash_mlx.server"), "the speculation core runs below generate"),
    (("dflash_mlx.models",), ("dflash_mlx.speculate",), "networks know no speculation policy"),
]
# ...and what the CLI may import only inside the command that launches it
LAUNCHED = ("dflash_mlx.server", "tui")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = module_files()


def public_names() -> dict[str, str]:
    """`from dflash_mlx import load` resolves through the package's lazy table."""
    tree = ast.parse(MODULES["dflash_mlx"].read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if getattr(target, "id", None) == "_PUBLIC":
                table = ast.literal_eval(node.value)
                return {k: "dflash_mlx" + v for k, v in table.items()}
    raise AssertionError("dflash_mlx/__init__.py has no _PUBLIC table")


PUBLIC = public_names()


def _resolve(name: str) -> str | None:
    """The longest known module that `name` is or lies in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _nodes(tree: ast.AST, top_only: bool):
    """Every node of `tree`; with `top_only`, those that run on import (no function bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not (top_only and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                            | ast.Lambda)):
                stack.append(child)


def imports_in(module: str, source: str, is_pkg: bool = False,
               top_only: bool = False) -> set[str]:
    """The package modules `source` (the text of `module`) imports: lazily or not, or with
    `top_only` on import only (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(source)
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            typing_only.update(id(n) for n in ast.walk(node))
    out = set()
    for node in _nodes(tree, top_only):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            names = []
            for a in node.names:
                full = f"{src}.{a.name}"
                if full in MODULES:
                    names.append(full)
                elif src == "dflash_mlx" and a.name in PUBLIC:
                    names.append(PUBLIC[a.name])
                else:
                    names.append(src)
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and (dep := _resolve(name)) and dep != module:
                out.add(dep)
    return out


def imports_of(module: str, top_only: bool = False) -> set[str]:
    path = MODULES[module]
    return imports_in(module, path.read_text(), path.name == "__init__.py", top_only)


GRAPH = {m: imports_of(m) for m in MODULES}


def layer(module: str) -> int:
    """The layer of the most specific prefix listed in LAYERS."""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


def test_imports_point_down():
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
              for m, deps in GRAPH.items() for d in deps
              if layer(d) > layer(m) and (m, d) not in ALLOWED_UPWARD]
    assert not upward, "\n".join(upward)


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def wrong_way(graph: dict[str, set[str]], top_graph: dict[str, set[str]]) -> list[str]:
    """The imports against DIRECTION, and the CLI's on-import imports of what it launches."""
    bad = [f"{m} imports {d}: {why}" for who, banned, why in DIRECTION
           for m, deps in graph.items() if _under(m, who)
           for d in sorted(deps) if _under(d, banned)]
    bad += [f"{m} imports {d} on import: only the command that launches it may"
            for m, deps in top_graph.items() if _under(m, ("dflash_mlx.cli",))
            for d in sorted(deps) if _under(d, LAUNCHED)]
    return bad


def test_imports_point_one_way():
    top = {m: imports_of(m, top_only=True) for m in MODULES}
    assert not (bad := wrong_way(GRAPH, top)), "\n".join(bad)


@pytest.mark.parametrize("module, source, top_only", [
    ("dflash_mlx.server.app", "from ..cli import render", False),
    ("dflash_mlx.server.app", "def f():\n    import dflash_mlx.cli.render", False),
    ("tui.app", "from dflash_mlx.cli.options import app", False),
    ("dflash_mlx.engine", "def f():\n    from .server import app", False),
    ("dflash_mlx.generate", "from .bench import runner", False),
    ("dflash_mlx.speculate.rounds", "from ..generate import Session", False),
    ("dflash_mlx.speculate.rounds", "from .. import engine", False),
    ("dflash_mlx.models.dflash", "from ..speculate import sampling", False),
    ("dflash_mlx.cli.main", "from ..server import app", True),
    ("dflash_mlx.cli.main", "import tui.launch", True),
])
def test_a_wrong_way_import_is_caught(module, source, top_only):
    deps = imports_in(module, source, top_only=top_only)
    assert wrong_way({module: deps}, {module: deps}), (module, source)


def test_the_cli_may_launch_lazily():
    source = "def chat():\n    from tui.launch import run_chat\n    from ..server import app\n"
    top = imports_in("dflash_mlx.cli.commands", source, top_only=True)
    lazy = imports_in("dflash_mlx.cli.commands", source)
    assert top == set() and lazy == {"tui.launch", "dflash_mlx.server.app"}
    assert wrong_way({"dflash_mlx.cli.commands": lazy}, {"dflash_mlx.cli.commands": top}) == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    # a package __init__ only re-exports; its lazy table is not a dependency of its children
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in GRAPH.items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer("dflash_mlx.models.dflash") < layer("dflash_mlx.generate") < layer("dflash_mlx.cli.main")


def _prints(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "print":
                found.append(f"print() line {node.lineno}")
            elif isinstance(f, ast.Name) and f.id == "Console":
                found.append(f"rich Console line {node.lineno}")
            elif (isinstance(f, ast.Attribute) and f.attr in ("write", "flush")
                  and isinstance(f.value, ast.Attribute) and f.value.attr in ("stdout", "stderr")):
                found.append(f"sys.{f.value.attr}.{f.attr} line {node.lineno}")
    return found


def test_nothing_below_the_cli_prints():
    bad = [f"{m}: {what}" for m, path in MODULES.items()
           if not m.startswith(SPEAKERS) for what in _prints(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("statement", ["import dflash_mlx", "import dflash_mlx.cli"])
def test_import_loads_no_model_code(statement):
    code = (f"import sys; {statement}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mlx', 'mlx_lm', 'transformers', 'numpy') or m.startswith('dflash_mlx.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]", out
