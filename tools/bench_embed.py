#!/usr/bin/env python3
"""Embeddings benchmark: inputs per second through POST /v1/embeddings at batch 1 and 32,
luced against llama-server --embeddings on the same GGUF, and how the model's vectors rank
a paraphrase against an unrelated sentence.

    python tools/bench_embed.py [--model PATH] [--inputs 64] [--words 24] [--threads 2]
        [--rounds 3] [--pooling mean] [--llama-server PATH] [--serve-args "..."]

Batch 1 sends --inputs requests of one input each, one after another (each waits for the
last: latency-bound); batch 32 sends requests of 32 inputs each, one after another, the
server batching them. Every input is a distinct sentence of about --words words. Both
servers run with --threads threads, the same pooling, 32 parallel sequences and a context
of --context tokens, and are measured in alternation over --rounds rounds (drift hits
both alike); the table gives medians and luced's ratio to llama-server. llama-server is
the --llama-server binary, or /tmp/llama-srv/build/bin/llama-server when that exists;
without one only luced is measured. Each round also checks that the two servers give the
same vectors (the worst cosine between their vectors of one input).

The ranking figure: for each (anchor, paraphrase, unrelated) triple, whether the anchor's
vector is closer (cosine) to the paraphrase's than to the unrelated sentence's, and the
mean margin, for luced's mean and last pooling.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

DEFAULT_LLAMA_SERVER = Path("/tmp/llama-srv/build/bin/llama-server")
BATCH = 32
NOUNS = ["cat", "river", "engine", "garden", "teacher", "storm", "violin", "harbor", "lantern",
         "meadow", "robot", "bakery"]  # fmt: skip
VERBS = ["watches", "follows", "repairs", "paints", "crosses", "finds", "carries", "measures",
         "hides", "greets"]  # fmt: skip
ADJS = ["quiet", "bright", "old", "heavy", "distant", "small", "golden", "broken", "patient",
        "curious"]  # fmt: skip
TRIPLES = [
    (
        "The cat is sleeping on the warm windowsill.",
        "A cat naps on the sunny window ledge.",
        "Interest rates rose sharply in the third quarter.",
    ),
    (
        "How do I reset my password?",
        "What are the steps to change a forgotten password?",
        "The recipe needs two cups of flour and an egg.",
    ),
    (
        "The train to Paris leaves at nine in the morning.",
        "At 9 am the Paris train departs.",
        "Photosynthesis turns sunlight into chemical energy.",
    ),
    (
        "She won the chess tournament last weekend.",
        "Last weekend she took first place in the chess competition.",
        "Our server crashed because the disk was full.",
    ),
    (
        "Drink plenty of water when it is hot outside.",
        "In hot weather, stay hydrated by drinking lots of water.",
        "The novel is set in a small village in Norway.",
    ),
    (
        "The museum is closed on Mondays.",
        "On Mondays the museum does not open.",
        "He plays the guitar in a jazz band.",
    ),
    (
        "Prices of electric cars are falling.",
        "Electric vehicles are getting cheaper.",
        "The baby laughed at the puppy.",
    ),
    (
        "The meeting was moved to Thursday afternoon.",
        "We rescheduled the meeting for Thursday after lunch.",
        "Volcanoes release gas and ash when they erupt.",
    ),
]


def sentences(n: int, words: int) -> list[str]:
    """n distinct sentences of about `words` words."""
    out = []
    for i in range(n):
        parts = []
        for j in itertools.count():
            k = i * 7 + j
            parts += [ADJS[k % len(ADJS)], NOUNS[(k * 3) % len(NOUNS)], VERBS[k % len(VERBS)]]
            if len(parts) >= words:
                break
        out.append(f"Sentence {i}: " + " ".join(parts[:words]) + ".")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/embeddings",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def vectors(url: str, inputs: list[str]) -> list[np.ndarray]:
    data = post(url, {"input": inputs, "encoding_format": "base64"})["data"]
    data.sort(key=lambda d: d["index"])
    return [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data]


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError("the server did not become healthy")


class Server:
    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: either server drains and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        self.proc.kill()  # a no-op once it has exited
        self.proc.wait()
        self.log.close()


def luced(args: argparse.Namespace, pooling: str, tmp: Path) -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "luced.cli", "serve", *([args.model] if args.model else []),
        "--port", str(port), "--runtime-dir", str(tmp / f"run-{port}"),
        "--threads", str(args.threads), "--context-length", str(args.context),
        "--max-running", str(BATCH), "--max-queue", str(2 * BATCH), "--pooling", pooling,
        "--log-level", "warning", *args.serve_args.split(),
    ]  # fmt: skip
    return Server(f"luced ({pooling})", cmd, port)


def llama_server(args: argparse.Namespace, binary: Path, model: str) -> Server:
    port = free_port()
    cmd = [
        str(binary), "-m", model, "--embeddings", "--pooling", args.pooling,
        "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads),
        "-np", str(BATCH), "-c", str(BATCH * args.context), "-b", "2048", "-ub", "2048",
        "--log-disable",
    ]  # fmt: skip
    return Server("llama-server", cmd, port)


def throughput(url: str, inputs: list[str], batch: int) -> float:
    """Inputs per second, `batch` inputs per request, one request at a time."""
    t0 = time.perf_counter()
    for i in range(0, len(inputs), batch):
        post(url, {"input": inputs[i : i + batch], "encoding_format": "base64"})
    return len(inputs) / (time.perf_counter() - t0)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def ranking(url: str) -> tuple[int, float]:
    """(triples whose paraphrase ranks above the unrelated sentence, mean cosine margin)."""
    wins, margins = 0, []
    for anchor, para, other in TRIPLES:
        a, p, o = vectors(url, [anchor, para, other])
        margin = cosine(a, p) - cosine(a, o)
        wins += margin > 0
        margins.append(margin)
    return wins, statistics.mean(margins)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--inputs", type=int, default=64, help="inputs per measurement")
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="context per sequence")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pooling", default="mean", choices=("mean", "cls", "last"))
    ap.add_argument("--llama-server", type=Path, help=f"default: {DEFAULT_LLAMA_SERVER}")
    ap.add_argument("--serve-args", default="", help="more `luced serve` options, one string")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from luced.serve.bundled import default_model_path

        model = str(default_model_path())
    binary = args.llama_server or DEFAULT_LLAMA_SERVER
    if not binary.exists():
        print(f"no llama-server at {binary}: measuring luced alone")
        binary = None
    inputs = sentences(args.inputs, args.words)
    runs: dict[tuple[str, int], list[float]] = {}
    worst_cos = 1.0
    with tempfile.TemporaryDirectory(prefix="luced-bench-embed-") as tmp:
        servers = [luced(args, args.pooling, Path(tmp))]
        try:
            if binary is not None:
                servers.append(llama_server(args, binary, model))
            for s in servers:  # warm-up: first calls, every batch size once
                throughput(s.url, inputs[:BATCH], BATCH)
                throughput(s.url, inputs[:2], 1)
            for _ in range(args.rounds):
                for batch in (1, BATCH):
                    for s in servers:
                        runs.setdefault((s.name, batch), []).append(
                            throughput(s.url, inputs, batch)
                        )
                if len(servers) == 2:
                    pairs = zip(*(vectors(s.url, inputs[:8]) for s in servers), strict=True)
                    worst_cos = min(worst_cos, *(cosine(a, b) for a, b in pairs))
            ranks = {args.pooling: ranking(servers[0].url)}
        finally:
            for s in servers:
                s.stop()
        other = "last" if args.pooling != "last" else "mean"
        s = luced(args, other, Path(tmp))
        try:
            ranks[other] = ranking(s.url)
        finally:
            s.stop()
    print(
        f"{Path(model).name}: {args.inputs} inputs of ~{args.words} words, {args.threads} "
        f"threads, pooling {args.pooling}, {args.rounds} rounds, medians"
    )
    print(f"{'server':16s} {'batch':>5s} {'inputs/s':>9s}  ratio")
    for batch in (1, BATCH):
        base = statistics.median(runs.get(("llama-server", batch), [0.0]))
        for s in servers:
            rate = statistics.median(runs[(s.name, batch)])
            ratio = f"{rate / base:5.2f}x" if base and s.name != "llama-server" else ""
            print(f"{s.name:16s} {batch:5d} {rate:9.1f}  {ratio}")
    if len(servers) == 2:
        print(f"luced vs llama-server vectors: worst cosine {worst_cos:.5f}")
    for kind, (wins, margin) in ranks.items():
        print(
            f"ranking ({kind} pooling): paraphrase closer than the unrelated sentence in "
            f"{wins}/{len(TRIPLES)} triples, mean cosine margin {margin:+.3f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
