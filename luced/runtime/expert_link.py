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
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import torch

from luced.gguf_file import GGUFFile
from luced.ipc import frames as F
from luced.ipc import links
from luced.ipc.channel import BlockingChannel, ChannelClosedError, RemoteError
from luced.ipc.links import expert_layout, scratch_rows
from luced.ipc.regions import Region
from luced.runtime.experts import ExpertsUnavailable, LocalExperts, plan
from luced.runtime.families import family_for
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
        with self.lock:
            experts = self.experts
            if experts is None:
                raise ValueError("expert_mix before load_experts")
            held = experts.held.get(req.layer)
            if held is None:
                raise ValueError(
                    f"layer {req.layer} has no experts here (MoE layers: {sorted(experts.held)})"
                )
            n, hidden = req.x.shape
            k = req.ids.shape[1]
            if hidden != self.hidden or req.x.dtype != "float32":
                raise ValueError(
                    f"x must be float32 [n, {self.hidden}], got {req.x.dtype} {list(req.x.shape)}"
                )
            if k > self.n_used:
                raise ValueError(f"k = {k} exceeds the model's {self.n_used} experts per token")
            x, ids, weights = self.view(req.x), self.view(req.ids), self.view(req.weights)
            if n and (int(ids.min()) < -1 or int(ids.max()) >= len(held)):
                raise ValueError(f"ids outside [-1, {len(held)}) for layer {req.layer}")
            x.copy_(experts.mix(req.layer, x, ids, weights))
            self.calls += 1
        return F.ExpertMixReply(elapsed_us=int((time.perf_counter() - t0) * 1e6))

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
