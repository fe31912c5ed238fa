"""Cold experts in another worker: the target's client (`RemoteExperts`) and the expert
worker's server (`ExpertServer`), over shared memory plus one small frame per call.

Per MoE layer, per forward (a prefill chunk is one call, not one per token)::

    target worker (RemoteExperts.mix)             expert worker (ExpertServer.mix)
    write x [n, H] f32, ids [n, k] int32,
      weights [n, k] f32 into its scratch
    expert_mix {layer, x, ids, weights}  ---->    view them in place, check the header,
                                                  y = Σ w_i · expert_i(x) (its local ids),
                                                  write y over x
    read y from the x rows               <----    {elapsed_us}  (or an error: bad header)

The scratch is a region of a segment the daemon owns (one per target worker, sized for its
largest batch; layout in `luced.ipc.links.expert_layout`); while a call is in flight only the
expert worker touches it, otherwise only the target. Rows beyond what the scratch holds go
in several calls. The connection is a socketpair the daemon hands to both workers
(`luced.ipc.links`); the target picks up a new one before each call, so a restarted expert
worker is used again as soon as the daemon links it. A closed or refusing peer raises
`ExpertsUnavailable`, and `experts.Split` falls back.

Across hosts (`HopExperts`: the two workers on different hosts) the rows travel over a
torch.distributed hop instead (``runtime/hops.py``; the daemon links it, the expert
worker's end with serve="experts"), one request and one answer per call::

    target worker                                    expert worker (a thread per hop)
    int64 [4]  layer, n, k, 0          ---->
    uint8 [n*H*4 + 2*n*k*4]  x f32, ids i32, weights f32
                                       <----         int64 [2]  n, 1 (0: refused, no rows)
                                       <----         float32 [n, H]  Σ w_i · expert_i(x)

A failed or refused call breaks the hop (`ExpertsUnavailable`, the fallback computes the
layer); the daemon sees the fallbacks in the forward's reply and links the hop again.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from luced.gguf_file import GGUFFile
from luced.ipc import frames as F
from luced.ipc import links
from luced.ipc.channel import BlockingChannel, ChannelClosedError, RemoteError
from luced.ipc.links import expert_layout, scratch_rows
from luced.ipc.regions import Region
from luced.runtime.experts import ExpertsUnavailable, LocalExperts, plan
from luced.runtime.families import family_for
from luced.runtime.hops import Hops
from luced.runtime.state import torch_device
from luced.runtime.weights import parse_dtype

log = logging.getLogger(__name__)

View = Callable[[Region], torch.Tensor]  # WorkerState.tensor: a region viewed in place


class RemoteExperts:
    """`experts.ExpertCompute` through an expert worker (see the module docstring)."""

    def __init__(self, inbox: socket.socket, scratch: Region, view: View) -> None:
        self.inbox, self.scratch, self.view = inbox, scratch, view
        self.channel: BlockingChannel | None = None
        # remote_us: round trips as the target sees them; remote_compute_us: the expert
        # worker's own time in them (the difference is what the link costs)
        self.stats = {"remote_calls": 0, "remote_bytes": 0, "remote_us": 0, "remote_compute_us": 0}

    def _pick_up(self) -> None:
        while (sock := links.take(self.inbox, block=False)) is not None:
            if self.channel is not None:
                self.channel.close()
            self.channel = BlockingChannel(sock)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _drop(self, why: str) -> ExpertsUnavailable:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        return ExpertsUnavailable(why)

    def mix(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        try:
            self._pick_up()
        except ConnectionError as exc:
            raise ExpertsUnavailable(str(exc)) from None
        if self.channel is None:
            raise ExpertsUnavailable("no expert worker is linked")
        n, hidden = x.shape
        k = ids.shape[1]
        step = scratch_rows(self.scratch.nbytes, hidden, k)
        if step < 1:
            raise ExpertsUnavailable(f"a {self.scratch.nbytes}-byte scratch fits no row")
        out = torch.empty(n, hidden, dtype=torch.float32)
        for a in range(0, n, step):
            b = min(n, a + step)
            out[a:b] = self._call(layer, x[a:b], ids[a:b], weights[a:b])
        return out.to(x.device, x.dtype)

    def _call(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        assert self.channel is not None
        rx, rids, rw = expert_layout(self.scratch, x.shape[0], x.shape[1], ids.shape[1])
        vx = self.view(rx)
        vx.copy_(x)
        self.view(rids).copy_(ids)
        self.view(rw).copy_(weights)
        t0 = time.perf_counter()
        try:
            reply = self.channel.call(F.ExpertMix(layer=layer, x=rx, ids=rids, weights=rw))
        except RemoteError as exc:  # refused: the call is redone elsewhere
            raise self._drop(f"the expert worker refused layer {layer}: {exc.error}") from None
        except (ChannelClosedError, ConnectionError, OSError) as exc:
            raise self._drop(f"the expert worker is gone: {exc}") from None
        self.stats["remote_calls"] += 1
        self.stats["remote_bytes"] += 2 * rx.nbytes + rids.nbytes + rw.nbytes
        self.stats["remote_us"] += int((time.perf_counter() - t0) * 1e6)
        assert isinstance(reply, F.ExpertMixReply)
        self.stats["remote_compute_us"] += reply.elapsed_us
        return vx.clone()


def _unpack(body: torch.Tensor, n: int, hidden: int, k: int) -> tuple[torch.Tensor, ...]:
    """x [n, hidden] f32, ids [n, k] i32, weights [n, k] f32 from one request body."""
    a, b = n * hidden * 4, n * hidden * 4 + n * k * 4
    return (
        body[:a].view(torch.float32).view(n, hidden),
        body[a:b].view(torch.int32).view(n, k),
        body[b:].view(torch.float32).view(n, k),
    )


class HopExperts:
    """`experts.ExpertCompute` through an expert worker on another host, over the hop
    `name` (module docstring). Stats as `RemoteExperts`'."""

    def __init__(self, hops: Hops, name: str) -> None:
        self.hops, self.name = hops, name
        self.stats = {"remote_calls": 0, "remote_bytes": 0, "remote_us": 0, "remote_compute_us": 0}

    def close(self) -> None:
        self.hops.drop(self.name)

    def mix(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        linked = self.hops.group(self.name)
        if linked is None:
            raise ExpertsUnavailable(f"hop {self.name} to the expert worker is not linked")
        group, peer, timeout = linked
        n, hidden = x.shape
        k = ids.shape[1]
        body = torch.cat(
            [t.contiguous().view(-1).view(torch.uint8) for t in (x.float(), ids, weights)]
        )
        t0 = time.perf_counter()
        answer = torch.empty(2, dtype=torch.int64)
        y = torch.empty(n, hidden, dtype=torch.float32)
        try:
            group.send([torch.tensor([layer, n, k, 0], dtype=torch.int64)], peer, 0).wait(timeout)
            group.send([body], peer, 0).wait(timeout)
            group.recv([answer], peer, 0).wait(timeout)
            if answer[1] != 1:
                raise ExpertsUnavailable(f"the expert worker refused layer {layer}")
            group.recv([y], peer, 0).wait(timeout)
        except (RuntimeError, ExpertsUnavailable) as exc:
            why = str(exc).splitlines()[0][:200]
            self.hops.broke(self.name, why)  # the daemon links it anew
            raise ExpertsUnavailable(f"hop {self.name}: {why}") from None
        self.stats["remote_calls"] += 1
        self.stats["remote_bytes"] += body.numel() + y.numel() * 4
        self.stats["remote_us"] += int((time.perf_counter() - t0) * 1e6)
        return y.to(x.device, x.dtype)


class ExpertServer:
    """The expert worker's experts and its `expert_mix` verb, served on every link the
    daemon hands over (a thread per link; the compute itself is serialised)."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.experts: LocalExperts | None = None
        self.fingerprint = ""
        self.hidden = 0
        self.n_used = 0
        self.lock = threading.Lock()
        self.calls = 0
        self._inbox_thread: threading.Thread | None = None

    def load(self, req: F.LoadExperts) -> F.LoadExpertsReply:
        t0 = time.monotonic()
        gguf = GGUFFile(req.model)
        cfg = family_for(gguf).config_from_gguf(gguf)
        if not cfg.moe.n_experts or req.hot >= cfg.moe.n_experts:
            raise ValueError(
                f"{req.model}: no cold experts with {req.hot} hot of {cfg.moe.n_experts}"
            )
        # as the target plans it (backend.load: experts.plan_for)
        target = plan(cfg.moe.n_experts, gguf.moe_layers(), req.hot, dict(req.moe_profile))
        placement = target.inverted()
        dtype, device = parse_dtype(req.dtype), torch_device(req.device)
        experts = LocalExperts(req.model, cfg.moe, placement.hot, dtype, device, req.weights)
        experts.load_all()
        with self.lock:
            self.experts, self.hidden, self.n_used = experts, cfg.hidden, cfg.moe.n_used
            self.fingerprint = target.fingerprint()
        log.info(
            "holding %d experts of %d layers",
            sum(map(len, placement.hot.values())),
            len(placement.hot),
        )
        return F.LoadExpertsReply(
            n_layers=len(placement.hot),
            n_held=sum(map(len, placement.hot.values())),
            fingerprint=self.fingerprint,
            load_s=time.monotonic() - t0,
        )

    def mix(self, req: F.ExpertMix) -> F.ExpertMixReply:
        t0 = time.perf_counter()
        if req.x.dtype != "float32" or req.x.shape[1] != self.hidden:
            raise ValueError(
                f"x must be float32 [n, {self.hidden}], got {req.x.dtype} {list(req.x.shape)}"
            )
        x = self.view(req.x)
        x.copy_(self.answer(req.layer, x, self.view(req.ids), self.view(req.weights)))
        return F.ExpertMixReply(elapsed_us=int((time.perf_counter() - t0) * 1e6))

    def answer(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ_i weights[:, i] · expert(ids[:, i])(x) of this worker's experts of `layer`;
        ValueError for a request it cannot serve (the header's checks)."""
        with self.lock:
            experts = self.experts
            if experts is None:
                raise ValueError("expert_mix before load_experts")
            held = experts.held.get(layer)
            if held is None:
                raise ValueError(
                    f"layer {layer} has no experts here (MoE layers: {sorted(experts.held)})"
                )
            n, hidden = x.shape
            if hidden != self.hidden:
                raise ValueError(f"x must be [n, {self.hidden}], got {list(x.shape)}")
            if ids.shape[1] > self.n_used:
                raise ValueError(
                    f"k = {ids.shape[1]} exceeds the model's {self.n_used} experts per token"
                )
            if n and (int(ids.min()) < -1 or int(ids.max()) >= len(held)):
                raise ValueError(f"ids outside [-1, {len(held)}) for layer {layer}")
            self.calls += 1
            return experts.mix(layer, x, ids, weights)

    def serve_hop(self, group: dist.ProcessGroup, peer: int) -> None:
        """Answer a target worker's calls on a hop (module docstring), on a thread of its
        own until the group ends (a new link, or the peer gone)."""
        threading.Thread(
            target=self._serve_hop, args=(group, peer), name="expert-hop", daemon=True
        ).start()

    def _serve_hop(self, group: dist.ProcessGroup, peer: int) -> None:
        idle = datetime.timedelta(days=365)  # calls come when the target computes a layer
        try:
            while True:
                head = torch.empty(4, dtype=torch.int64)
                group.recv([head], peer, 0).wait(idle)
                layer, n, k, _ = head.tolist()
                body = torch.empty(n * (self.hidden + 2 * k) * 4, dtype=torch.uint8)
                group.recv([body], peer, 0).wait()
                x, ids, weights = _unpack(body, n, self.hidden, k)
                try:
                    y, ok = self.answer(layer, x, ids, weights), 1
                except ValueError as exc:
                    log.warning("refused an expert call on a hop: %s", exc)
                    y, ok = torch.empty(0), 0
                group.send([torch.tensor([n, ok], dtype=torch.int64)], peer, 0).wait()
                if ok:
                    group.send([y.float().contiguous()], peer, 0).wait()
        except RuntimeError as exc:  # the group was aborted (a new link) or the peer left
            log.info("expert hop closed: %s", str(exc).splitlines()[0][:200])

    def _handle_peer(self, req: F.Request) -> F.Reply:
        if not isinstance(req, F.ExpertMix):
            raise ValueError(f"a link serves expert_mix only, not {req.OP}")
        return self.mix(req)

    def serve_inbox(self, inbox: socket.socket) -> None:
        """Serve every link handed over through `inbox`, each on its own thread (started
        once; returns at once)."""
        if self._inbox_thread is not None:
            return

        def accept() -> None:
            while True:
                try:
                    sock = links.take(inbox, block=True)
                except (ConnectionError, OSError):
                    return  # the daemon is gone; the worker exits with its control socket
                if sock is not None:
                    threading.Thread(target=self._serve_link, args=(sock,), daemon=True).start()

        self._inbox_thread = threading.Thread(target=accept, name="expert-inbox", daemon=True)
        self._inbox_thread.start()

    def _serve_link(self, sock: socket.socket) -> None:
        channel = BlockingChannel(sock)
        try:
            channel.serve(self._handle_peer)
        except Exception as exc:  # an unreadable frame: drop this link, keep the others
            log.warning("expert link closed: %s", exc)
        finally:
            channel.close()
