"""The layering rule, checked on every import (module level, function level, TYPE_CHECKING):

    ipc, cache + shared leaves  <  text, runtime  <  engine  <  api  <  serve  <  cli

A module imports only from its own package or from a lower rank; nothing outside
``luced/runtime`` imports it; no import cycle between modules; and the daemon side never
loads torch (checked in a subprocess).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "luced"

SHARED_LEAVES = ("luced.sampling_params", "luced.gguf_file", "luced.acceptance", "luced.values")
RANKS = {
    "luced.ipc": 0,
    **dict.fromkeys(SHARED_LEAVES, 0),
    "luced.cache": 0,
    "luced.text": 1,
    "luced.runtime": 1,
    "luced.engine": 2,
    "luced.api": 3,
    "luced.serve": 4,
    "luced.cli": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit(module: str) -> str:
    """The ranked unit a module belongs to: its top-level package or shared leaf."""
    for name in sorted(RANKS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} is in no rank: add it to RANKS")


def imports_of(module: str) -> set[str]:
    """Every luced module `module` imports, anywhere in its body."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            # `from luced.x import y` names module luced.x.y when that is a module.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n == "luced" or n.startswith("luced."))
    return {n for n in found if n in MODULES and n != module}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_is_ranked() -> None:
    assert {unit(m) for m in MODULES if m != "luced"} <= RANKS.keys()
    assert {"luced.engine.core", "luced.serve.daemon", "luced.text.tokenizer"} <= MODULES.keys()


def test_imports_point_down() -> None:
    upward = []
    for module, targets in GRAPH.items():
        if module == "luced":
            continue
        own = unit(module)
        for target in targets:
            theirs = unit(target)
            if (theirs != own and RANKS[theirs] >= RANKS[own] and RANKS[own] > 0) or (
                RANKS[own] == 0 and RANKS[theirs] > 0
            ):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_only_runtime_imports_runtime() -> None:
    bad = [
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if unit(t) == "luced.runtime" and unit(m) != "luced.runtime"
    ]
    assert not bad, "\n".join(sorted(bad))


def test_no_module_cycles() -> None:
    # Depth-first search for a back edge; the path to it is the cycle.
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_walk_sees_function_level_and_type_checking_imports() -> None:
    # luced.runtime.families.gemma3 imports KVCache only under TYPE_CHECKING.
    assert "luced.runtime.kv_cache" in GRAPH["luced.runtime.families.gemma3"]


def test_daemon_side_never_imports_torch() -> None:
    # One interpreter imports the modules in turn; the first that pulls torch in is named.
    daemon_side = [m for m in MODULES if m != "luced" and unit(m) != "luced.runtime"]
    code = (
        "import sys, importlib\n"
        f"for m in {daemon_side!r}:\n"
        "    importlib.import_module(m)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(m); sys.exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout.strip()} imports torch {proc.stderr[-2000:]}"
