"""The prefix cache through the real daemon: HTTP usage, lucectl, restarts, bad files.

Correctness oracle everywhere: the same greedy request answered by a daemon (or a run)
that computed the whole prompt; a restored prefix must not change a token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from test_daemon import client, raw_post

from luced.runtime.tiny import make_tiny_gguf

PROMPT = "The printing press changed how people shared ideas across Europe. " * 4
# Prose, not a repeated line: its continuation has the near-ties that rounding can move.
HISTORY = (
    "Rivers shaped the first cities. Farmers along the Nile learned to read its floods, "
    "and scribes kept records of each year's height so that taxes matched the harvest. In "
    "Mesopotamia the Tigris and Euphrates were less kind: their floods came late and "
    "violent, so the people there dug canals, built levees and argued for centuries over "
    "who owned the water. Trade followed the same routes, carrying copper, cedar and grain. "
)


def complete(d: DaemonProcess, prompt: str = PROMPT, max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, _, reply = raw_post(d, "/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


ONE = ("--kv-block-size", "0")  # no block pool: the disk tier keeps snapshot files


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(reply: dict) -> str:
    return reply["choices"][0]["text"]


def snapshots(d: DaemonProcess) -> list[dict]:
    return d.lucectl_json("snapshot", "list")["snapshots"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name, family, seed in (("a", "llama", 5), ("b", "qwen3", 6)):
        out[name] = root / f"tiny-{name}.gguf"
        make_tiny_gguf(family, out[name], seed=seed, layers=4, context=2048)
    return out


# -- memory tier, over HTTP and lucectl, on the bundled chat model -------------------------


@pytest.mark.real_model
def test_two_turn_chat_lucectl_and_worker_kill(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path).start()
    try:
        oa = client(d)
        messages = [
            {"role": "system", "content": "You are a concise assistant. " * 8},
            {"role": "user", "content": "Name three colors."},
        ]
        first = oa.chat.completions.create(
            model=d.model_name, messages=messages, temperature=0, max_tokens=16
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And three animals?"},
        ]
        second = oa.chat.completions.create(
            model=d.model_name, messages=messages, temperature=0, max_tokens=16
        )
        hit = second.usage.prompt_tokens_details.cached_tokens
        # The whole first prompt (system + first user turn + the assistant header) is reused:
        # its blocks were kept in the workers' pool (--kv-keep-tokens), which wins over a
        # restore of its snapshot (a copy).
        assert first.usage.prompt_tokens - 1 <= hit < second.usage.prompt_tokens
        totals = d.lucectl_json("status")["totals"]
        assert totals["cached_prompt_tokens"] == hit
        computed = totals["prompt_tokens"] - totals["cached_prompt_tokens"]
        assert computed == first.usage.prompt_tokens + second.usage.prompt_tokens - hit
        assert d.metric("luced:prefix_kept_tokens_total") == hit
        assert d.metric("luced:prefix_cache_hits_total") == 0
        assert d.metric("luced:prefix_cache_queries_total") == totals["prompt_tokens"]
        assert d.metric("luced:prefix_cache_bytes", 'tier="memory"') > 0

        # Several running requests share a block pool: the prompts' whole K/V blocks are
        # kept in host records (the first prompt's are the second's first ones), no
        # snapshot, no arena.
        n = second.usage.prompt_tokens
        cache = d.lucectl_json("status")["prefix_cache"]
        assert (cache["memory_blocks"], cache["entries"]) == (n // 16, 0)
        assert cache["memory_bytes"] == cache["memory_block_bytes"] > 0
        assert snapshots(d) == [] and not [s for s in d.segments() if "arena" in s]
        assert (
            f"keeps prompts as K/V blocks, {n // 16} in memory"
            in d.lucectl("snapshot", "list").stdout
        )

        # A worker killed -9: the host records are the daemon's, the blocks survive.
        pid = d.worker_pid()
        os.kill(pid, signal.SIGKILL)
        d.wait_health(503, 10)
        d.wait_health(200, 60)
        assert d.worker_pid() != pid
        again = oa.chat.completions.create(
            model=d.model_name, messages=messages, temperature=0, max_tokens=16
        )
        # The kept blocks died with the worker: the blocks in memory are restored, whole
        # blocks leaving one token to compute.
        restored = (n - 1) // 16 * 16
        assert again.usage.prompt_tokens_details.cached_tokens == restored
        assert again.choices[0].message.content == second.choices[0].message.content
        assert d.metric("luced:prefix_cache_hits_total") == restored

        # drop, save without a disk tier, clear.
        bad = d.lucectl("snapshot", "drop", "nosuchid", check=False)
        assert bad.returncode == 1 and "no snapshot 'nosuchid'" in bad.stderr
        no_disk = d.lucectl("snapshot", "save", check=False)
        assert no_disk.returncode == 1 and "--kv-cache-dir" in no_disk.stderr
        unconfirmed = d.lucectl("cache", "clear", check=False)
        assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr
        oa.chat.completions.create(
            model=d.model_name, messages=messages[:2], temperature=0, max_tokens=2
        )
        cleared = d.lucectl_json("cache", "clear", "--yes")
        # The blocks in memory, and the last request's kept in the pool.
        assert cleared["cleared"] == n // 16 and cleared["kept_dropped"] == 1
        assert d.lucectl_json("status")["prefix_cache"]["memory_blocks"] == 0
        assert d.lucectl_json("status")["queue"]["kv_kept_requests"] == 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []


@pytest.mark.real_model
def test_a_prompt_restored_part_way_answers_as_fresh(smollm2_gguf, tmp_path) -> None:
    """The daemon's defaults (`--weights auto`, prefill chunks of 512): a prompt whose first
    418 of 436 tokens are another prompt's (shared from its blocks kept in the pool, which
    the prefix cache's 26 whole blocks in memory do not beat) answers with the tokens and
    logprobs of the same prompt computed whole, bit for bit."""
    from luced.gguf_file import GGUFFile
    from luced.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_gguf))
    ids = tok.encode(HISTORY * 6)[:436]
    assert len(ids) == 436
    other = ids[:418] + tok.encode(" Nobody in the villages had heard of it yet.")

    def ask(prompt: list[int], max_tokens: int) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"logprobs": 2, "ignore_eos": True}
        status, _, reply = raw_post(d, "/v1/completions", json.dumps(body).encode())
        assert status == 200, reply
        return reply

    d = DaemonProcess(smollm2_gguf, tmp_path).start()
    try:
        ask(other, 1)
        restored = ask(ids, 8)
        assert cached(restored) == 418
        # The two prompts' whole blocks in memory, each once (keyed by its whole prefix).
        blocks = {tuple(p[: (i + 1) * 16]) for p in (ids, other) for i in range(len(p) // 16)}
        assert d.lucectl_json("cache", "clear", "--yes")["cleared"] == len(blocks)
        fresh = ask(ids, 8)
        assert cached(fresh) == 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []
    assert restored["choices"][0]["logprobs"] == fresh["choices"][0]["logprobs"]
    assert text(restored) == text(fresh)


# -- disk tier: restarts and bad files, on tiny models --------------------------------------


@pytest.mark.parametrize(
    ("devices", "running"),
    [("cpu", 8), ("cpu,cpu:1", 8), ("cpu", 1)],
    ids=["unsplit", "split", "one-running"],
)
def test_restart_serves_from_disk(tiny, devices, running, tmp_path) -> None:
    """Several running requests (the default) or one: the disk tier keeps the prompt's
    whole K/V blocks, a file per worker's part, and a restarted daemon restores them.
    Snapshot files of the older format in the model's directory move to its quarantine/
    (one log line)."""
    kv = tmp_path / "kv"
    args = ("--kv-cache-dir", str(kv), "--target-devices", devices, "--max-running", str(running))
    d = DaemonProcess(tiny["a"], tmp_path / "one", *args).start()
    try:
        expected = complete(d)
        assert cached(expected) == 0
        assert d.lucectl_json("snapshot", "save")["saved"] == 0  # waits for the writes
        cache = d.lucectl_json("status")["prefix_cache"]
        whole = expected["usage"]["prompt_tokens"] // 16  # the prompt's whole blocks
        assert (cache["disk_blocks"], cache["disk_entries"]) == (whole, 0)
        assert (cache["memory_blocks"], snapshots(d)) == (whole, [])  # no arena
    finally:
        assert d.stop() == 0
    parts = list(kv.glob("*/blocks/*"))  # kv/<model fingerprint>/blocks/<worker's part>
    assert len(parts) == len(devices.split(","))
    assert all(len(list(p.glob("*.kvb"))) == whole for p in parts)
    assert not list(kv.glob("*/blocks/*/*.tmp")) and not list(kv.glob("*/*.safetensors"))
    model_dir = parts[0].parent.parent
    for name in ("aaaa0001", "aaaa0002"):
        (model_dir / f"{name}.safetensors").write_bytes(b"an older daemon's snapshot")

    d = DaemonProcess(tiny["a"], tmp_path / "two", *args).start()
    try:
        assert f"{whole} K/V blocks" in d.log() and snapshots(d) == []
        assert d.log().count("snapshot files of the older format") == 1
        assert sorted(p.name for p in (model_dir / "quarantine").iterdir()) == [
            "aaaa0001.safetensors",
            "aaaa0002.safetensors",
        ]
        reply = complete(d)
        n = reply["usage"]["prompt_tokens"]
        assert cached(reply) == (n - 1) // 16 * 16  # the whole blocks, one token left
        assert text(reply) == text(expected)
        assert d.metric("luced:prefix_cache_hits_total") == cached(reply)
        # cache clear --disk removes the files too: every block, in memory and on disk.
        assert d.lucectl_json("cache", "clear", "--disk", "--yes")["cleared"] == whole
        assert snapshots(d) == [] and not list(kv.glob("*/blocks/*/*.kvb"))
        assert d.lucectl_json("status")["prefix_cache"]["disk_blocks"] == 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def _one_file(model: Path, tmp: Path, *args: str) -> tuple[Path, str]:
    """Run a daemon once on `model` with its own (empty) cache dir: the snapshot file it
    wrote, and its reply, computed from the whole prompt. `--kv-block-size 0`: no block
    pool, so snapshot files (a block pool keeps K/V blocks instead)."""
    kv = tmp / "kv"
    d = DaemonProcess(model, tmp, "--kv-cache-dir", str(kv), *ONE, *args).start()
    try:
        reply = complete(d)
        assert cached(reply) == 0
    finally:
        assert d.stop() == 0  # shutdown waits for the background write
    (path,) = kv.glob("*/*.safetensors")  # kv/<model fingerprint>/<id>.safetensors
    return path, text(reply)


def test_bad_files_are_quarantined_and_requests_still_succeed(tiny, tmp_path) -> None:
    good, expected = _one_file(tiny["a"], tmp_path / "good")
    foreign_model, _ = _one_file(tiny["b"], tmp_path / "model")
    foreign_placement, _ = _one_file(tiny["a"], tmp_path / "split", "--target-devices", "cpu,cpu:1")
    # The bad files go where this model's snapshots live: its own directory.
    kv = tmp_path / "kv" / good.parent.name
    kv.mkdir(parents=True)
    data = good.read_bytes()
    (kv / "aaaa0001.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    flipped = bytearray(data)
    for i in range(len(flipped) - 4000, len(flipped) - 3000):  # inside the K/V data
        flipped[i] ^= 0xFF
    (kv / "aaaa0002.safetensors").write_bytes(bytes(flipped))
    shutil.copy(foreign_model, kv / "aaaa0003.safetensors")
    shutil.copy(foreign_placement, kv / "aaaa0004.safetensors")
    (kv / "aaaa0005.safetensors.tmp").write_bytes(data[:100])  # a crashed write

    d = DaemonProcess(tiny["a"], tmp_path / "d", "--kv-cache-dir", str(kv.parent), *ONE).start()
    try:
        # Scan: truncated, foreign model and foreign placement out; flipped bytes pass the
        # header checks and are caught by the CRC at restore time.
        quarantined = sorted(p.name for p in (kv / "quarantine").iterdir())
        assert quarantined == [f"aaaa000{i}.safetensors" for i in (1, 3, 4)]
        assert not list(kv.glob("*.tmp"))
        log = d.log()
        for name in quarantined:
            assert f"{name}" in log and "quarantine" in log
        assert [s["id"] for s in snapshots(d)] == ["aaaa0002"]
        reply = complete(d)
        assert text(reply) == expected and cached(reply) == 0  # prefilled instead
        assert (kv / "quarantine" / "aaaa0002.safetensors").exists()
        assert d.health()[0] == 200
        # The request's own snapshot replaced it; the next one is a hit.
        again = complete(d)
        assert text(again) == expected and cached(again) > 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []


# -- a hybrid (recurrent layers) with the defaults ------------------------------------------


def test_hybrid_serves_with_defaults(tmp_path) -> None:
    """A qwen35 GGUF (Gated DeltaNet layers) starts with the defaults, the prefix cache in
    exact-cut mode over K/V blocks (several requests run: a block pool): the recurrent
    state is kept at the prompt's last whole block, so a repeated prompt and one that
    extends it restore its whole blocks, and the replies equal uncached ones."""
    model = tmp_path / "tiny-qwen35.gguf"
    make_tiny_gguf("qwen35", model, seed=5, layers=4, context=2048)
    first, longer = PROMPT.strip(), PROMPT.strip() + " Then what happened next?"
    d = DaemonProcess(model, tmp_path).start()
    try:
        assert "prefix cache: exact-cut mode for tiny-qwen35.gguf" in d.log()
        assert "block ends" in d.log()
        a, again, b = complete(d, first), complete(d, first), complete(d, longer)
        assert text(a) == text(again) and a["usage"]["completion_tokens"] == 12
        blocks = (a["usage"]["prompt_tokens"] - 1) // 16 * 16
        assert blocks > 0 and (cached(a), cached(again), cached(b)) == (0, blocks, blocks)
        assert snapshots(d) == []  # blocks and states, no snapshot
    finally:
        assert d.stop() == 0
    d = DaemonProcess(model, tmp_path / "off", "--prefix-cache-bytes", "0").start()
    try:
        assert text(complete(d, longer)) == text(b)
        assert snapshots(d) == []  # no cache: nothing kept
    finally:
        assert d.stop() == 0
