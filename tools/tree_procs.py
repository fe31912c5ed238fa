"""One child process per source tree, asked in turn: the harness of the tree-against-tree
benchmarks (tools/bench_step.py, tools/bench_frames.py).

Each child is `python SCRIPT --serve ...` with PYTHONPATH and the working directory set to
its tree (`python -m luced.runtime.worker`, which a child may start, puts the working
directory first on sys.path: in another directory another tree's code would run). A child
answers each line of input (a count) with one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any


class TreeProcs:
    def __init__(self, trees: list[str], argv: list[str]) -> None:
        """Start `python *argv` once per tree."""
        self.procs: list[subprocess.Popen] = []
        for tree in map(os.path.abspath, trees):
            env = {**os.environ, "PYTHONPATH": tree}
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    cwd=tree,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )

    def readline(self, i: int) -> str:
        return self.procs[i].stdout.readline()  # type: ignore[union-attr]

    def ask(self, i: int, n: int) -> Any:
        """Send child i the count n; its JSON answer."""
        p = self.procs[i]
        p.stdin.write(f"{n}\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.readline(i))

    def orders(self, rounds: int) -> Iterator[list[int]]:
        """The children's order in each round: forward, then backward, alternating, so
        drift on a shared machine hits them alike."""
        for r in range(rounds):
            order = list(range(len(self.procs)))
            yield order[::-1] if r % 2 else order

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait()
