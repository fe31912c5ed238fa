"""IPC test fixtures: a leak check on /dev/shm and one sample frame per op."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import posix_ipc
import pytest

from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.ipc.shm import scan


@pytest.fixture(scope="session")
def session_tag() -> str:
    """Prefix of every instance id this session's tests use (see ``instance``)."""
    return secrets.token_hex(3)


@pytest.fixture(scope="session", autouse=True)
def no_segments_left(session_tag: str) -> Iterator[None]:
    """After the whole session, no luced segment of ours may remain in /dev/shm.

    "Ours" = owned by this process, or named with this session's instance tag (the
    owner subprocesses of the tests). Segments of other daemons or test sessions on
    this machine are theirs to judge. Leaks are removed, then reported.
    """
    yield
    mine = f"/luced-{session_tag}"
    leaked = [
        info for info in scan() if info.owner_pid == os.getpid() or info.name.startswith(mine)
    ]
    for info in leaked:
        with contextlib.suppress(posix_ipc.Error):
            posix_ipc.unlink_shared_memory(info.name)
    assert not leaked, f"shared-memory segments left behind: {[i.name for i in leaked]}"


@pytest.fixture
def instance(session_tag: str) -> str:
    """A fresh instance id per test, so tests and parallel sessions never collide."""
    return session_tag + secrets.token_hex(2)


@pytest.fixture
def run_py() -> Iterator[object]:
    """Start ``python -c CODE ARGS...`` with pipes; every process is reaped at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(code: str, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


SEG = "/luced-0123abcd-act"


def region(offset: int, shape: tuple[int, ...], dtype: str) -> Region:
    return Region(SEG, offset, shape, dtype)


@pytest.fixture
def sample_requests() -> dict[str, F.Request]:
    """One populated request per op (covering optional fields where there are any)."""
    return {
        "hello": F.Hello(
            instance="0123abcd",
            files={"/models/x.gguf": F.FileIdentity(size=123, sha256="ab" * 32)},
        ),
        "load": F.Load(
            model="/models/x.gguf",
            layers=(4, 30),
            dtype="bfloat16",
            devices=("cuda:0", "cuda:1"),
            kv_capacity=4096,
            owns_embed=False,
            owns_head=True,
            device_splits=(12,),
            moe_hot=4,
            moe_scratch=region(4096, (65536,), "uint8"),
            moe_required=True,
            kv_dtype="float16",
            kv_block=16,
            kv_blocks=600,
            kv_scored=True,
        ),
        "load_experts": F.LoadExperts(
            model="/models/x.gguf",
            dtype="float32",
            device="cpu:1",
            hot=4,
        ),
        "expert_mix": F.ExpertMix(
            layer=4,
            x=region(4096, (3, 64), "float32"),
            ids=region(8192, (3, 2), "int32"),
            weights=region(8256, (3, 2), "float32"),
        ),
        "forward": F.Forward(
            spans=(
                F.Span(
                    sequence=3,
                    start=100,
                    n=16,
                    n_out=16,
                    sampling={"temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 2**40},
                    ring=region(4096, (64, 3, 576), "float32"),
                    copies=((6, 40, 41),),
                    blocks=(42,),
                    table=8,
                    moves=((0, 2, 17, 5), (1, 3, 17, 0)),
                    kv_scores=region(8192, (2, 8), "float32"),
                ),
                F.Span(
                    sequence=5,
                    start=7,
                    n=2,
                    n_out=2,
                    sampling={
                        "temperature": 0.8,
                        "seed": 5,
                        "min_p": None,
                        "logit_bias": {"7": -1.5},
                    },
                    verify=True,
                    ring=region(4096, (64, 3, 576), "float32"),
                    moves=((0, 1, 3, 0), (1, 4, 3, 2)),
                    table=5,
                ),
            ),
            want="sample",
            outputs={
                "ids": region(64, (18,), "int32"),
                "logprobs": region(128, (18,), "float32"),
                "topk_ids": region(192, (18, 5), "int32"),
                "topk_logprobs": region(576, (18, 5), "float32"),
            },
            tokens=region(960, (512,), "int32"),
            top_logprobs=5,
            capture=(1, 14, 27),
            draft_probs=region(16384, (15, 49152), "float32"),
            allowed=region(64, (64, 1536), "int32"),
            kv_host=region(65536, (16, 4096), "uint8"),
        ),
        "load_draft": F.LoadDraft(
            path="/models/draft", dtype="bfloat16", device="cuda:1", target="/models/x.gguf"
        ),
        "draft": F.DraftBlock(
            ring=region(4096, (64, 3, 576), "float32"),
            committed=100,
            anchor=42,
            outputs={
                "ids": region(64, (16,), "int32"),
                "probs": region(128, (15, 49152), "float32"),
            },
            block_size=16,
            mask_token_id=49151,
            ctx_window=2048,
            sampling={"temperature": 0.7, "top_p": 0.9, "seed": 3},
        ),
        "kv_layout": F.KVLayout(),
        "kv_export": F.KVExport(
            position=100,
            regions={
                "k.4": region(64, (3, 128, 64), "bfloat16"),
                "v.4": region(49216, (3, 128, 64), "bfloat16"),
            },
        ),
        "kv_import": F.KVImport(
            position=90,
            regions={
                "k.4": region(64, (3, 128, 64), "bfloat16"),
                "v.4": region(49216, (3, 128, 64), "bfloat16"),
            },
            tokens=region(98368, (128,), "int32"),
            blocks=(3, 4, 5, 6, 7, 8),
        ),
        "kv_forget": F.KVForget(ids=("3f9a0c12d4e1", "0b")),
        "kv_share": F.KVShare(sequence=2, source=1, position=96),
        "kv_page": F.KVPage(
            sequence=70,
            moves=((0, 3, 12, 5), (0, 4, 2, 6)),
            kv_host=region(64, (16, 4096), "uint8"),
        ),
        "kv_files": F.KVFiles(
            action="write",
            model="0123456789abcdef0123456789abcdef",
            part="b16-bf16-L15-30-1a2b3c4d",
            kv_host=region(64, (16, 4096), "uint8"),
            records=(3, 4),
            parents=bytes(16) + bytes(range(16)),
            tokens=bytes(range(128)),
        ),
        "truncate": F.Truncate(position=57),
        "reset": F.Reset(sequence=3, release=True, keep_sampler=True),
        "ping": F.Ping(),
        "link": F.Link(
            hop="act-0",
            generation=3,
            rank=1,
            store="10.0.0.2:7071",
            address="10.0.0.1",
            timeout_s=30.0,
        ),
        "stats": F.Stats(),
        "shutdown": F.Shutdown(),  # last: a served channel ends after it
    }


@pytest.fixture
def sample_replies() -> dict[str, F.Reply]:
    return {
        "hello": F.HelloReply(
            pid=4242,
            group="cpu:1",
            devices=("cpu",),
            versions={"python": "3.11.7", "torch": "2.13.0"},
            store="10.0.0.2:7071",
            prefix_cache_bytes=1 << 30,
        ),
        "load": F.LoadReply(
            n_layers=30,
            hidden=576,
            vocab=49152,
            layers=(4, 30),
            dtype="bfloat16",
            kv_capacity=4096,
            load_s=1.25,
            moe_fingerprint="0123456789abcdef",
            kv_record_bytes=4096,
        ),
        "load_experts": F.LoadExpertsReply(n_layers=2, n_held=4, fingerprint="ab", load_s=0.1),
        "expert_mix": F.ExpertMixReply(elapsed_us=120),
        "forward": F.ForwardReply(positions=(116, 8), elapsed_us=8123, accepted=(-1, 0)),
        "load_draft": F.LoadDraftReply(
            capture_layers=(1, 10, 19, 28),
            block_size=16,
            mask_token_id=None,
            hidden=576,
            load_s=0.4,
        ),
        "draft": F.DraftBlockReply(n=15, ctx=64, elapsed_us=2100),
        "kv_layout": F.KVLayoutReply(tensors=(("k.4", 3, 64), ("v.4", 3, 64)), dtype="bfloat16"),
        "kv_export": F.KVExportReply(position=100, elapsed_us=950),
        "kv_import": F.KVImportReply(position=90, elapsed_us=870),
        "truncate": F.TruncateReply(position=57),
        "kv_forget": F.KVForgetReply(dropped=1),
        "kv_share": F.KVShareReply(position=96),
        "kv_page": F.KVPageReply(paged=7),
        "kv_files": F.KVFilesReply(disk=True, done=2, gone=bytes(range(16))),
        "reset": F.ResetReply(),
        "stats": F.StatsReply(stats={"rss_bytes": 123456789, "busy_s": 1.5, "device": "cpu"}),
        "ping": F.PingReply(),
        "link": F.LinkReply(elapsed_us=2500),
        "shutdown": F.ShutdownReply(),
    }
