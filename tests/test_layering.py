"""Layering rules: the daemon side never imports torch; ipc never imports upwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "luced"


def daemon_side_modules() -> list[str]:
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if rel.parts[1:2] == ("runtime",):
            continue
        mods.append(".".join(p for p in rel.parts if p != "__init__"))
    return mods


def test_there_are_daemon_modules_to_check() -> None:
    assert {
        "luced.engine.core",
        "luced.serve.daemon",
        "luced.text.tokenizer",
        "luced.ipc.frames",
    } <= set(daemon_side_modules())


def test_daemon_side_never_imports_torch() -> None:
    # One interpreter imports the modules in turn; the first that pulls torch in is named.
    code = (
        "import sys, importlib\n"
        f"for m in {daemon_side_modules()!r}:\n"
        "    importlib.import_module(m)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(m); sys.exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout.strip()} imports torch {proc.stderr[-2000:]}"


def test_ipc_does_not_import_daemon_or_runtime() -> None:
    for path in (PACKAGE / "ipc").glob("*.py"):
        text = path.read_text()
        for banned in ("luced.runtime", "luced.engine.core", "luced.api", "luced.serve.daemon"):
            assert banned not in text, f"{path.name} imports {banned}"
