"""`luced` command line: `luced serve [MODEL.gguf | NAME] [options]` (see `luced serve --help`;
NAME is a bundled model's, `luced.serve.bundled.BUNDLED`), `luced train-draft TARGET.gguf
OUT_DIR [options]` (train_draft.py), and `luced worker --listen ADDR:PORT ...`, a backend
worker for a daemon on another host (`luced worker --help`; it runs ``luced.runtime.listen``
in this interpreter, so this module never imports torch)."""

from __future__ import annotations

import os
import sys
import traceback


def explain(exc: BaseException) -> str:
    """A start-up failure as one line: its own message, or (a bare `TimeoutError()`, an
    OSError with only an errno) its kind and where it was raised; never blank."""
    text = str(exc).strip()
    if text and not text.isdigit():
        return text
    kind = type(exc).__name__
    if text:  # OSError(errno): the number alone
        kind += f" [Errno {text}] {os.strerror(int(text))}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {frames[-1].name} ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return (
        f"start-up failed: {kind}{where}, with no message. The log lines above show the "
        "step it was in; --log-level debug shows more"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"}:
        from luced.serve.bundled import BUNDLED

        print(
            "usage: luced serve [MODEL.gguf | NAME] [options]\n"
            "       luced train-draft TARGET.gguf OUT_DIR [options]\n"
            "       luced worker --listen ADDR:PORT --worker-key-file FILE --model FILE\n\n"
            f"serve        Serve a GGUF model (or a bundled one by NAME: {', '.join(BUNDLED)})\n"
            "             over an OpenAI-compatible HTTP API.\n"
            "train-draft  Train a DFlash draft for a target model on its own answers.\n"
            "worker       Run a backend worker for a daemon on another host.\n"
            "Run `luced serve --help`, `luced train-draft --help` or `luced worker --help`\n"
            "for the options."
        )
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"luced {version('luced')}")
        return 0
    if argv[0] == "train-draft":
        from luced.cli import train_draft

        return train_draft.main(argv[1:])
    if argv[0] == "worker":
        os.execv(sys.executable, [sys.executable, "-m", "luced.runtime.listen", *argv[1:]])
    if argv[0] != "serve":
        print(f"luced: unknown command {argv[0]!r} (try `luced serve --help`)", file=sys.stderr)
        return 2
    from luced.engine.placement import PlacementError
    from luced.gguf_file import GGUFError
    from luced.serve.bundled import BundledModelMissing
    from luced.serve.config import ConfigError, load_config
    from luced.serve.daemon import StartupError, run

    try:
        return run(load_config(argv[1:]))
    except (
        ConfigError,
        GGUFError,
        BundledModelMissing,
        PlacementError,
        StartupError,
        OSError,
    ) as exc:
        # Start-up problems a user can fix: one clear line, no traceback.
        print(f"luced: {explain(exc)}", file=sys.stderr)
        return 2
