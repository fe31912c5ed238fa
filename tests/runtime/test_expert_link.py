"""Cold experts in a real expert worker process (the test plays the daemon: it starts the
worker, owns the scratch segment and hands both sides their link): remote == in process ==
all local, bad headers refused while the worker keeps serving, and a killed worker falls
back in process with the same tokens (or fails cleanly when the remote is required)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from luced.gguf_file import GGUFFile
from luced.ipc import frames as F
from luced.ipc import links
from luced.ipc.channel import BlockingChannel, RemoteError
from luced.ipc.links import expert_layout, scratch_bytes
from luced.ipc.regions import Attachments, Region
from luced.ipc.shm import HEADER_SIZE, ShmOwner
from luced.runtime import experts
from luced.runtime.expert_link import RemoteExperts
from luced.runtime.model import Model
from luced.runtime.qlinear import PackedLinear
from luced.runtime.tiny import make_tiny_gguf
from tests.runtime.test_experts import PROMPT, greedy, highest_ids_most_routed, placed
from tests.worker_harness import TAG, WorkerProc, no_segments_left  # noqa: F401

HOT = 4  # of the tiny models' 8 experts per layer: half cold


@pytest.fixture(scope="module", params=["qwen3moe", "qwen35moe", "laguna"])
def tiny(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    make_tiny_gguf(request.param, path, seed=5, qtype="Q8_0")
    return path


class Daemon:
    """What the daemon owns here: the scratch segment, the expert worker, the links."""

    def __init__(self, tmp_path: Path, model: Path) -> None:
        self.instance = f"{TAG}{os.urandom(2).hex()}"
        self.shm = ShmOwner(self.instance)
        seg = self.shm.create("moe-0", HEADER_SIZE + scratch_bytes(64, 64, 8))
        self.scratch = Region(seg.name, HEADER_SIZE, (seg.size - HEADER_SIZE,), "uint8")
        self.model = model
        self.worker = self.start_worker(tmp_path)
        self.inbox, self.target_inbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.attachments = Attachments()
        self.remotes: list[RemoteExperts] = []

    def start_worker(self, tmp_path: Path) -> WorkerProc:
        w = WorkerProc(tmp_path, inbox=True)
        w.call(F.Hello(instance=self.instance))
        return w

    def load_experts(
        self,
        placement: experts.Placement,
        profile: dict[int, tuple[int, ...]] | None = None,
        weights: str = "dequant",
    ) -> F.LoadExpertsReply:
        hot = len(placement.hot[placement.layers[0]])
        req = F.LoadExperts(
            model=str(self.model),
            dtype="float32",
            device="cpu",
            hot=hot,
            moe_profile=tuple((profile or {}).items()),
            weights=weights,
        )
        reply = self.worker.call(req)
        assert isinstance(reply, F.LoadExpertsReply)
        return reply

    def link(self, to: socket.socket) -> None:
        """One link: the caller's end into `to` (an inbox), the server's to the worker."""
        caller, server = links.link_pair()
        links.hand_over(to, caller)
        assert self.worker.inbox is not None
        links.hand_over(self.worker.inbox, server)

    def remote(self) -> RemoteExperts:
        r = RemoteExperts(
            self.target_inbox, self.scratch, lambda r: torch.from_numpy(self.attachments.view(r))
        )
        self.remotes.append(r)
        return r

    def close(self) -> None:
        for r in self.remotes:
            r.close()
        self.worker.stop()
        self.attachments.close()
        self.inbox.close()
        self.target_inbox.close()
        self.shm.unlink_all()


@pytest.fixture
def daemon(tiny: Path, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path, tiny)
    yield d
    d.close()


def test_remote_equals_in_process_equals_all_local(daemon: Daemon) -> None:
    local = Model.load(daemon.model)
    want_logits, want = greedy(local, PROMPT, 8)
    inproc, _ = placed(daemon.model, HOT)
    inproc_logits, inproc_tokens = greedy(inproc, PROMPT, 8)

    # the hot experts by a routing profile: both sides plan the same ones from it
    remote, profile = daemon.remote(), highest_ids_most_routed(daemon.model)
    split, placement = placed(daemon.model, HOT, profile=profile, cold=remote, required=True)
    assert placement.hot[placement.layers[0]] == (4, 5, 6, 7)
    assert daemon.load_experts(placement, profile).fingerprint == placement.fingerprint()
    daemon.link(daemon.inbox)
    got_logits, got = greedy(split, PROMPT, 8)
    torch.testing.assert_close(got_logits, inproc_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got == inproc_tokens == want
    # one call per MoE layer per forward: the prompt's chunk is one call, not 12
    forwards, n_moe = 1 + 8, len(placement.layers)
    assert 0 < remote.stats["remote_calls"] <= forwards * n_moe
    assert split.expert_split.stats["fallbacks"] == 0


def test_packed_cold_experts_remote_equal_in_process(daemon: Daemon) -> None:
    """Under a compact weights mode the expert worker packs its experts as the target's
    in-process fallback does: the same answer, bit for bit."""
    placement = experts.plan_for(daemon.model, HOT)
    assert placement is not None
    daemon.load_experts(placement, weights="int4")
    daemon.link(daemon.inbox)
    remote = daemon.remote()
    cfg = Model.load(daemon.model).cfg
    local = experts.LocalExperts(
        daemon.model, cfg.moe, placement.inverted().hot, torch.float32, weights="int4"
    )
    gen = torch.Generator().manual_seed(0)
    for n in (1, 9):  # decode, prefill
        x = torch.randn(n, cfg.hidden, generator=gen)
        ids = torch.randint(-1, HOT, (n, cfg.moe.n_used), generator=gen, dtype=torch.int32)
        weights = torch.rand(n, cfg.moe.n_used, generator=gen)
        for layer in placement.layers:
            assert torch.equal(
                remote.mix(layer, x, ids, weights), local.mix(layer, x, ids, weights)
            )
    assert isinstance(local.experts(placement.layers[0]).down[0], PackedLinear)


def test_layer_split_shards_share_the_expert_worker(daemon: Daemon) -> None:
    local = Model.load(daemon.model)
    n = local.cfg.n_layers
    _, want = greedy(local, PROMPT, 6)
    remote = daemon.remote()
    first, placement = placed(daemon.model, HOT, layers=(0, n // 2), cold=remote, required=True)
    second, _ = placed(daemon.model, HOT, layers=(n // 2, n), cold=remote, required=True)
    daemon.load_experts(placement)
    daemon.link(daemon.inbox)
    c1, c2 = first.new_cache(64), second.new_cache(64)

    def step(ids: list[int], start: int) -> torch.Tensor:
        h, _ = first.forward_layers(first.embed(torch.tensor(ids)), c1, start)
        h, _ = second.forward_layers(h, c2, start)
        return second.logits(h)

    logits, got = step(PROMPT, 0), []
    for _ in range(6):
        got.append(int(logits[-1].argmax()))
        logits = step(got[-1:], len(PROMPT) + len(got) - 1)
    assert got == want
    assert remote.stats["remote_calls"] > 0


def test_bad_headers_are_refused_and_the_worker_keeps_serving(daemon: Daemon) -> None:
    cfg = Model.load(daemon.model).cfg
    placement = experts.plan(cfg.moe.n_experts, GGUFFile(daemon.model).moe_layers(), HOT)
    daemon.load_experts(placement)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon.link(theirs)
    chan = BlockingChannel(links.take(mine, block=False))
    s, h, k, n = daemon.scratch, cfg.hidden, cfg.moe.n_used, 3
    x, ids, weights = expert_layout(s, n, h, k)
    daemon.attachments.view(ids)[:] = 0
    layer = placement.layers[0]
    bad = {
        "layer": F.ExpertMix(layer=999, x=x, ids=ids, weights=weights),
        "k": F.ExpertMix(
            layer=layer,
            x=x,
            ids=Region(s.segment, ids.offset, (n, k + 1), "int32"),
            weights=Region(s.segment, weights.offset, (n, k + 1), "float32"),
        ),
        "hidden": F.ExpertMix(
            layer=layer,
            x=Region(s.segment, s.offset, (n, h + 1), "float32"),
            ids=ids,
            weights=weights,
        ),
        "segment": F.ExpertMix(
            layer=layer,
            x=Region(s.segment, s.offset + s.nbytes, (n, h), "float32"),
            ids=ids,
            weights=weights,
        ),
    }
    daemon.attachments.view(ids)[0, 0] = HOT + 5  # beyond the worker's 4 experts
    with pytest.raises(RemoteError, match="ids outside"):
        chan.call(F.ExpertMix(layer=layer, x=x, ids=ids, weights=weights))
    daemon.attachments.view(ids)[:] = 0
    for req in bad.values():
        with pytest.raises(RemoteError):
            chan.call(req)
    reply = chan.call(F.ExpertMix(layer=layer, x=x, ids=ids, weights=weights))  # still serving
    assert isinstance(reply, F.ExpertMixReply)
    chan.close()
    mine.close()


def test_killed_expert_worker_falls_back_with_the_same_tokens(
    daemon: Daemon, tmp_path: Path
) -> None:
    local = Model.load(daemon.model)
    _, want = greedy(local, PROMPT, 8)
    remote = daemon.remote()
    split, placement = placed(daemon.model, HOT, cold=remote)
    daemon.load_experts(placement)
    daemon.link(daemon.inbox)
    cache = split.new_cache(64)
    logits, got = split.forward(torch.tensor(PROMPT), cache, 0), []
    for step in range(8):
        if step == 3:
            os.kill(daemon.worker.pid, signal.SIGKILL)
            daemon.worker.proc.wait()
        got.append(int(logits[-1].argmax()))
        logits = split.forward(torch.tensor(got[-1:]), cache, len(PROMPT) + len(got) - 1)
    assert got == want
    assert split.expert_split.stats["fallbacks"] > 0
    calls_before = remote.stats["remote_calls"]
    # the daemon restarts it and links it again: the next forward is remote again
    daemon.worker.stop()
    daemon.worker = daemon.start_worker(tmp_path)
    daemon.load_experts(placement)
    daemon.link(daemon.inbox)
    split.forward(torch.tensor(got[-1:]), cache, len(PROMPT) + len(got))
    assert remote.stats["remote_calls"] > calls_before


def test_required_remote_fails_cleanly_when_the_worker_dies(daemon: Daemon) -> None:
    split, placement = placed(daemon.model, HOT, cold=daemon.remote(), required=True)
    daemon.load_experts(placement)
    daemon.link(daemon.inbox)
    os.kill(daemon.worker.pid, signal.SIGKILL)
    daemon.worker.proc.wait()
    with pytest.raises(experts.ExpertsUnavailable, match="gone"):
        split.forward(torch.tensor(PROMPT), split.new_cache(64), 0)
