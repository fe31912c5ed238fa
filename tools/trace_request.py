"""How far one streamed token walks through the daemon's modules.

Runs the real daemon (``luced.cli serve``) in this process with a profile hook, streams one
chat completion from a client thread, and reports for the decode tokens of that request:

    files per token      distinct luced source files executing while one token is produced
    re-entries per token times execution comes back into a file it had already left during
    (mean)               that token's walk

A token's walk runs from one call of the incremental detokenizer's ``push`` to the next.
Only the daemon process is traced (the worker is another process); library code (aiohttp,
asyncio, msgpack) is skipped, so a move is a call or return between two luced files. Usage::

    python tools/trace_request.py [MODEL.gguf] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Walk:
    """Collects the sequence of luced files execution moves through, per token."""

    def __init__(self) -> None:
        self.on = False
        self.tokens: list[list[str]] = [[]]
        import luced

        self.root = str(Path(luced.__file__).parent) + os.sep

    def _file(self, frame: FrameType | None) -> str | None:
        name = frame.f_code.co_filename if frame is not None else ""
        return name[len(self.root) :] if name.startswith(self.root) else None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        here = self._file(frame if event == "call" else frame.f_back)
        if here is None:
            return
        if event == "call" and frame.f_code.co_name == "push" and "detokenize" in here:
            self.tokens.append([])
        current = self.tokens[-1]
        if not current or current[-1] != here:
            current.append(here)

    def report(self) -> dict[str, float]:
        walks = [w for w in self.tokens[2:-1] if w]  # whole decode tokens only
        files = [len(set(w)) for w in walks]
        reentries = [len(w) - len(set(w)) for w in walks]
        return {
            "tokens": len(walks),
            "files_per_token": sum(files) / len(files),
            "reentries_per_token": sum(reentries) / len(reentries),
            "moves_per_token": sum(len(w) for w in walks) / len(walks),
            "files": sorted({f for w in walks for f in w}),
            "one_walk": walks[len(walks) // 2],
        }


def client(port: int, tokens: int, walk: Walk, done: threading.Event) -> None:
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        body = {
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
        }
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        walk.on = True
        with urllib.request.urlopen(req, timeout=600) as r:
            for _ in r:
                pass
        walk.on = False
    finally:
        done.set()
        os.kill(os.getpid(), signal.SIGTERM)  # the daemon drains and exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: the bundled model)")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    port = free_port()
    walk, done = Walk(), threading.Event()
    runtime = tempfile.mkdtemp(prefix="luced-trace-")
    argv = ["luced", "serve", *([args.model] if args.model else [])]
    argv += ["--port", str(port), "--runtime-dir", runtime]
    threading.Thread(target=client, args=(port, args.tokens, walk, done), daemon=True).start()
    from luced import cli

    sys.argv = argv
    threading.setprofile(None)
    sys.setprofile(walk.profile)
    try:
        cli.main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    done.wait(10)
    print(json.dumps(walk.report(), indent=2))


if __name__ == "__main__":
    main()
