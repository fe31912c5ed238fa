"""The layer split across two hosts against the same split over shared memory, in one run
(`python tools/bench_split.py --remote`; root: host B is a network namespace, tools/netlab.py).

    shm        cpu,cpu:1                      both stages here, the boundary in shared memory
    tcp +N ms  cpu,tcp://HOST_B:PORT/cpu      the second stage a `luced worker` on host B,
                                              the bridge adding N ms each way

Both Targets are loaded at once and measured interleaved (per round: shm, tcp +0, shm,
tcp +1, shm, tcp +5), so drift on a shared machine hits them alike; medians over rounds.
Every worker has --cores threads (the pipeline runs one stage at a time).

Bytes on the wire are counted by the bridge: every Ethernet frame between the hosts (the
control connection, the torch.distributed store and the hop's gloo sockets, with their
TCP/IP headers and acknowledgements). Per decode token: a decode step's bytes; per
prefill chunk: the prompt's bytes over its chunks (--prompt 128 is two chunks of 64). The
hop's own count (hidden rows only) is shown beside them.

The bridge is a Python process that copies each frame through AF_PACKET sockets, on the
same cores as the workers: "+0 ms" is a slow LAN, not a free one.

From the measured bytes per token it estimates what 1 and 10 Gbit/s links allow for a
27B model (Gemma 3 27B: hidden 5376): the wire time of a decode token and of a prefill
chunk of 512 tokens, float32 rows as measured (bfloat16 rows would halve the rows' part).
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import netlab  # run as a script: tools/ is on sys.path

from luced.engine.driver import Driver
from luced.engine.remote import RemoteSettings
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.files import identify
from luced.ipc.shm import ShmOwner
from luced.ipc.tcp import read_key

PORT = 7690
CHUNK = 64  # prompt tokens per prefill chunk (max_batch_tokens)
HIDDEN_27B = 5376  # Gemma 3 27B
ESTIMATE_CHUNK = 512  # the daemon's default --max-batch-tokens


def start_worker(lab: netlab.Lab, key: Path, model: Path, threads: int) -> subprocess.Popen:
    """`luced worker --listen` on host B, once it listens; its log is drained to keep its
    pipe from filling, the last lines kept for an error."""
    argv = [sys.executable, "-m", "luced.cli", "worker", "--listen", f"{lab.b}:{PORT}"]
    argv += ["--worker-key-file", str(key), "--threads", str(threads), "--model", str(model)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = lab.popen_b(argv, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines = [*lines[-20:], line]
        if "listening on" in line:
            break
    else:
        raise RuntimeError("the worker on host B exited:\n" + "".join(lines))
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc


def wire_bytes(lab: netlab.Lab) -> int:
    """The bridge's count of bytes forwarded between the hosts so far."""
    fields = dict(word.split("=", 1) for word in lab.wire("stats").split())
    return int(fields["bytes"])


async def one_run(
    d: Driver, prompt: list[int], n: int, wire: Callable[[], int]
) -> dict[str, float]:
    greedy = {"temperature": 0}
    b0 = wire()
    t0 = time.perf_counter()
    s = await d.prefill(prompt, greedy)
    ttft = time.perf_counter() - t0
    b1 = wire()
    token = s.token
    t1 = time.perf_counter()
    for _ in range(n - 1):
        token = (await d.step(token, greedy)).token
    decode = time.perf_counter() - t1
    b2 = wire()
    return {
        "ttft_ms": ttft * 1e3,
        "tok_s": (n - 1) / decode,
        "chunk_b": (b1 - b0) / math.ceil(len(prompt) / CHUNK),
        "token_b": (b2 - b1) / (n - 1),
    }


async def bench_remote(name: str, path: Path, args: argparse.Namespace) -> None:
    delays = [float(d) for d in args.delays.split(",")]
    gguf = GGUFFile(path)
    n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
    hidden = int(gguf.require(f"{gguf.arch}.embedding_length"))
    vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    prompt = [(97 + 31 * i) % vocab for i in range(args.prompt)]

    def placement(devices: tuple[str, ...]) -> TargetPlacement:
        return TargetPlacement.split(
            model=str(path),
            n_layers=n_layers,
            dtype="float32",
            kv_capacity=args.prompt + args.tokens + 8,
            max_batch_tokens=CHUNK,
            devices=devices,
            threads=args.cores,
        )

    with netlab.Lab() as lab, tempfile.TemporaryDirectory() as tmp, ShmOwner() as owner:
        key = Path(tmp) / "worker.key"
        key.write_text(secrets.token_hex(32))
        key.chmod(0o600)
        worker = start_worker(lab, key, path, args.cores)
        settings = RemoteSettings(key=read_key(key), files={str(path): identify(path)})
        shm = Target(owner, placement(("cpu", "cpu:1")), name="shm")
        tcp = Target(
            owner, placement(("cpu", f"tcp://{lab.b}:{PORT}/cpu")), name="tcp", remote=settings
        )
        try:
            await shm.start()
            await tcp.start()
            results: dict[str, list[dict[str, float]]] = {"shm": []}
            for delay in delays:
                results[f"tcp +{delay:g} ms"] = []
            for _ in range(args.rounds):
                for delay in delays:
                    results["shm"].append(await one_run(Driver(shm), prompt, args.tokens, int))
                    lab.wire(f"delay {delay}")
                    run = await one_run(Driver(tcp), prompt, args.tokens, lambda: wire_bytes(lab))
                    results[f"tcp +{delay:g} ms"].append(run)
            lab.wire("delay 0")
            (hop,) = tcp.hops.describe()
            report(name, hidden, args, results, hop["bytes_per_token"])
        finally:
            await tcp.close()
            await shm.close()
            worker.terminate()
            worker.wait(30)


def report(
    name: str,
    hidden: int,
    args: argparse.Namespace,
    results: dict[str, list[dict[str, float]]],
    hop_per_token: float,
) -> None:
    med = {
        label: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for label, runs in results.items()
    }
    base = med["shm"]
    print(
        f"{name}: prompt {args.prompt} tokens ({math.ceil(args.prompt / CHUNK)} chunks of "
        f"{CHUNK}), {args.tokens} generated, {args.rounds} rounds, {args.cores} threads per "
        f"worker, float32, greedy; medians. The hop moves {hop_per_token:g} B of hidden rows "
        f"per token (hidden {hidden} x 4 B)."
    )
    header = ["placement", "decode tok/s", "vs shm", "TTFT ms", "vs shm"]
    header += ["wire B / decode token", "wire B / prefill chunk"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, m in med.items():
        wire = label != "shm"
        cells = [
            label,
            f"{m['tok_s']:.1f}",
            f"{100 * m['tok_s'] / base['tok_s']:.0f}%",
            f"{m['ttft_ms']:.0f}",
            f"{100 * m['ttft_ms'] / base['ttft_ms']:.0f}%",
            f"{m['token_b']:.0f}" if wire else "-",
            f"{m['chunk_b']:.0f}" if wire else "-",
        ]
        print("| " + " | ".join(cells) + " |")
    zero = next(m for label, m in med.items() if label != "shm")
    estimate(zero["token_b"], zero["chunk_b"], hidden)


def estimate(token_b: float, chunk_b: float, hidden: int) -> None:
    """The wire time a 27B model's hidden rows take, from the measured overheads."""
    per_token = token_b - 4 * hidden  # headers, the control frames, acknowledgements
    per_chunk = chunk_b - 4 * hidden * CHUNK
    token_27b = per_token + 4 * HIDDEN_27B
    chunk_27b = per_chunk + 4 * HIDDEN_27B * ESTIMATE_CHUNK
    print(
        f"27B estimate (hidden {HIDDEN_27B}, float32 rows): {token_27b / 1e3:.1f} kB per decode "
        f"token per hop ({per_token:.0f} B of it overhead), {chunk_27b / 1e6:.1f} MB per "
        f"prefill chunk of {ESTIMATE_CHUNK}"
    )
    for gbit in (1, 10):
        rate = gbit * 1e9 / 8
        print(
            f"  {gbit:>2} Gbit/s: {token_27b / rate * 1e3:.3f} ms of wire per decode token "
            f"(at most {rate / token_27b:,.0f} tok/s per hop), {chunk_27b / rate * 1e3:.1f} ms "
            f"per prefill chunk ({ESTIMATE_CHUNK * rate / chunk_27b:,.0f} prompt tok/s)"
        )
