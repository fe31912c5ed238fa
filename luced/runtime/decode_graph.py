"""A decode step as fixed-shape device work, captured once per bucket as a CUDA graph and
replayed, so GPU decoding is not bound by Python and kernel launches.

An eager decode step of an 8B model is about a thousand small kernels, each launched by
Python at a few microseconds apiece: on an H100 that is longer than reading the weights.
A CUDA graph replays them all with one launch. A graph fixes every shape and every
address, and runs no Python: positions, row maps and the token fed must come from device
tensors that the host fills before each replay, never from Python integers.

So the step runs over the paged K/V of `kv_blocks` (one `BlockPool` for every sequence of
the shard) through a `StepBatch`, a ragged batch of T tokens per sequence (1 to decode, or
a DFlash / n-gram verify window) whose fields are fixed-size device tensors (B = the
bucket's sequences, T its tokens per sequence, L its attended rows):

    ids         [B·T] int64   the tokens each sequence feeds
    positions   [B·T] int64   their positions (from its cache's fill position)
    write_rows  [B·T] int64   the pool row each token's K/V goes to
    rows        [B, L] int64  its row map (`PagedKVCache.rows`): the pool row of each
                              position < L; rows past its last position point anywhere (masked)

The families take the batch as their `start` and `cache`, as they take a `Ragged`: RoPE
reads `positions` (`Rope.tables`), and `common.cached_attention` hands the attention to
`StepBatch.attend`, which stores the new K/V rows at `write_rows` and attends with SDPA
over the rows gathered through the map ([B, Hkv, L, D]), each token masked past its own
position and outside a sliding window. Padding (unused slots of a bucket, a window shorter
than T) feeds token 0 and writes a scratch block past the daemon's (`BlockPool.scratch`),
so those writes land nowhere that is read, and its logits are dropped. A window's rows
past what verification accepts are rolled back by the cache's truncate, as in the eager
forward (the position moves; the blocks stay in the daemon's table).

Compiled (`compile=True`, `--decode-graphs compile`): each bucket's step also goes through
`torch.compile` (Inductor) before it is captured, so the forty-odd small kernels of a layer
(norms, RoPE, the K/V store, masks, residual adds) fuse into a few; the matrix kernels stay
the packed ones. The first step of each bucket compiles (seconds on a GPU machine, more on a
large model); on the CPU the compiled step runs without a graph, which is how it is checked.
The model's own methods each hold an inference_mode that torch.compile cannot trace into,
so the step calls their mode-free forms (`embed_rows`, `run_layers`, `head_logits`) inside
one inference_mode of its own.

`DecodeGraphs` keeps one graph per (B, L) bucket (B a power of two up to 64, L a power of two
from 256 up to the capacity), captured on first use from a warm-up with the real inputs
(the warm-up writes the very rows the replay writes). A pool that reallocates (it grew)
drops every graph. On the CPU there is nothing to capture: the same step runs eagerly,
which is how its values are checked against the model's own batched forward without a GPU.

Scope: whole models (one shard holding the embedding and the head) of attention families
whose decode step syncs nothing with the host: llama, qwen3, gemma3, gemma4 without MoE.
MoE routing counts tokens per expert on the host and recurrent layers step per sequence;
those decode eagerly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

import torch

from luced.runtime.kv_blocks import BlockPool, PagedKVCache
from luced.runtime.layers import Rope, apply_rope
from luced.runtime.paged_attention import gather_attention, triton_attention
from luced.runtime.ragged import Ragged

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ATTENTION = {"gather": gather_attention, "triton": triton_attention}
# Tokens per sequence: 1 to decode, a verify window's length rounded up to a power of two.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class WholeModel(Protocol):
    """What the runner uses of a loaded model (`luced.runtime.model.Model`, which imports
    the families, which import this module: a protocol keeps the imports one way)."""

    family: ModuleType
    cfg: Any
    layers: range
    ropes: dict[int, Rope]
    owns_embed: bool
    owns_head: bool

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def run_layers(
        self, hidden: torch.Tensor, cache: Any, start: Any, capture: Any = (), ids: Any = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def _kv_sources(self) -> dict[int, int]: ...


MIN_ROWS = 256  # the smallest attended length L


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest size that holds n."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def row_buckets(capacity: int) -> tuple[int, ...]:
    """Attended lengths: powers of two from MIN_ROWS, then the capacity itself."""
    sizes, size = [], MIN_ROWS
    while size < capacity:
        sizes.append(size)
        size *= 2
    return (*sizes, capacity)


class StepBatch(Ragged):
    """T tokens for each of B sequences (one to decode, or a verify window), as fixed-size
    device tensors (module docstring); row b·T + t is sequence b's token t. `reserve` and
    `commit` do nothing: the runner does both on the caches, outside the captured work."""

    def __init__(
        self,
        pool: BlockPool,
        batch: int,
        rows: int,
        sources: dict[int, int] | None = None,
        tokens: int = 1,
        attention: str = "gather",
    ) -> None:
        """sources: a KV-sharing layer -> the layer whose rows it reads; attention: "gather"
        or "triton" (`paged_attention`)."""
        device = pool.device
        self.pool = pool
        self.sources = dict(sources or {})
        self.spans = ()
        self.batch, self.tokens = batch, tokens
        self.sizes = [tokens] * batch
        self.n = batch * tokens
        self.end = rows  # RoPE tables reach this far (grown before a capture)
        self.ids = torch.zeros(self.n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.n, dtype=torch.int64, device=device)
        # the pool row each token's K/V goes to: its sequence's row of its position, or a
        # scratch row for a padding token (a window shorter than T, an unused slot)
        self.write_rows = torch.zeros(self.n, dtype=torch.int64, device=device)
        self.position_list = []  # the native CPU kernels never see this batch
        self.rows = torch.zeros(batch, rows, dtype=torch.int64, device=device)
        self.attention = ATTENTION[attention]

    def reserve(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def per_sequence(self, fn: Callable[..., torch.Tensor], *rows: torch.Tensor | None):
        raise NotImplementedError("a captured decode step runs no per-sequence code")

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        window: int | None,
        scale: float,
        rope: Rope | None,
    ) -> torch.Tensor:
        """q [B·T, H, D]; kv: this layer's new rows [B·T, Hkv, D] to store (None: a
        KV-sharing layer, which reads its source's); rope: the rotation q and k still need
        -> [B·T, H·D]."""
        if rope is not None:
            cos, sin = rope.tables(self, self.n, q.dtype)
            q = apply_rope(q, cos, sin)
            if kv is not None:
                kv = (apply_rope(kv[0], cos, sin), kv[1])
        source = self.sources.get(layer, layer)
        keys, values = self.pool.k[source], self.pool.v[source]  # [Hkv, pool rows, D]
        if kv is not None:
            keys.index_copy_(1, self.write_rows, kv[0].transpose(0, 1).to(keys.dtype))
            values.index_copy_(1, self.write_rows, kv[1].transpose(0, 1).to(values.dtype))
        out = self.attention(q, keys, values, self.rows, self.positions, window, scale)
        return out.flatten(1)


def supports(model: WholeModel) -> str | None:
    """Why `model` cannot decode through a captured step, or None when it can."""
    if not (model.owns_embed and model.owns_head):
        return "a split model (graphs cover a whole model)"
    recurrent = getattr(model.family, "recurrent_shapes", None)
    if recurrent is not None and recurrent(model.cfg, model.layers):
        return "recurrent layers step per sequence"
    if getattr(getattr(model.cfg, "moe", None), "n_experts", 0):
        return "MoE routing syncs with the host"
    return None


class DecodeGraphs:
    """Decode steps of a whole model over one `BlockPool`, one graph per (B, L) bucket on a
    CUDA device, eager elsewhere. `step(caches, ids)` feeds ids[i] to caches[i] (paged caches
    of `pool`, each fed only through this runner or the model) and returns the logits
    [len(caches), vocab] float32."""

    def __init__(
        self,
        model: WholeModel,
        pool: BlockPool,
        capacity: int,
        *,
        capture: bool = True,
        compile: bool = False,
        attention: str = "gather",
    ) -> None:
        """capture False: run the same fixed-shape step eagerly on a GPU too (what a graph
        saves is measured against it); compile: through torch.compile first (module
        docstring); attention: "gather" or "triton" (`paged_attention`)."""
        why = supports(model)
        if why is not None:
            raise ValueError(f"no captured decode for this model: {why}")
        self.model = model
        self.pool = pool
        self.capacity = capacity
        self.row_sizes = row_buckets(capacity)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {sorted(ATTENTION)}, got {attention!r}")
        self.attention = attention
        self.compile = compile  # turned off when a step cannot be compiled
        self.compile_error: str | None = None
        if compile:  # each bucket is one more compile of the same step: let all of them be
            buckets = len(BATCH_BUCKETS) * len(TOKEN_BUCKETS) * len(self.row_sizes)
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, buckets + 8)
        self.captures = 0  # graphs captured (a pool that grows makes more)
        self.steps = 0  # steps run
        self.windows = 0  # of them, steps with a verify window (more than a token a sequence)
        self._generation = pool.generation
        for rope in {id(r): r for r in model.ropes.values()}.values():
            rope.table(capacity)  # grown now: a graph reads the tables it saw
        on_gpu = capture and pool.device.type == "cuda"
        self._graph_pool = torch.cuda.graph_pool_handle() if on_gpu else None

    def step(
        self,
        caches: Sequence[PagedKVCache],
        ids: torch.Tensor,
        sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Feed ids to the caches, sizes[i] of them to caches[i] from its position (default
        one each: a decode step; more: a verify window) -> the logits of every fed token
        [len(ids), vocab], in order."""
        return self.step_capturing(caches, ids, sizes)[0]

    def step_capturing(
        self,
        caches: Sequence[PagedKVCache],
        ids: torch.Tensor,
        sizes: Sequence[int] | None = None,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`step`, also returning the outputs of the layers in `capture` (a DFlash target's
        feature rows) for every fed token: -> (logits, {layer: [len(ids), hidden]})."""
        n = len(caches)
        sizes = [1] * n if sizes is None else list(sizes)
        if not n or len(sizes) != n or sum(sizes) != ids.numel() or min(sizes) < 1:
            raise ValueError(f"{ids.numel()} ids for {n} sequences of sizes {sizes}")
        if any(c.pool is not self.pool for c in caches):
            raise ValueError("every sequence of a captured step must hold its rows in its pool")
        end = max(c.pos + k for c, k in zip(caches, sizes, strict=True))
        if end > self.capacity:
            raise ValueError(f"position {end - 1} is past the captured capacity {self.capacity}")
        for c, k in zip(caches, sizes, strict=True):
            c.reserve(c.pos, k)  # (the daemon's blocks: `forward` followed them first)
        if self.pool.generation != self._generation:
            self.graphs.clear()  # they read the tensors the pool replaced
            self._generation = self.pool.generation
        tokens = bucket(max(sizes), TOKEN_BUCKETS)
        key = (bucket(n, BATCH_BUCKETS), tokens, bucket(end, self.row_sizes), capture)
        captured = self.graphs.get(key)
        if captured is None:
            captured = _Captured(
                self.model, self.pool, *key, compile=self.compile, attention=self.attention
            )
            self.graphs[key] = captured
        self._fill(captured.batch, caches, ids, sizes)
        logits, layers = captured.run(self._graph_pool)
        if captured.compile_error is not None and self.compile:
            self.compile, self.compile_error = False, captured.compile_error
            log.warning(
                "decode graphs: not compiled (%s); steps run uncompiled", self.compile_error
            )
        self.captures += captured.take_capture()
        for c, k in zip(caches, sizes, strict=True):
            c.commit(c.pos + k)
        self.steps += 1
        self.windows += tokens > 1
        if tokens == 1:
            rows: slice | torch.Tensor = slice(0, n)
        else:
            fed = [i * tokens + j for i, k in enumerate(sizes) for j in range(k)]
            rows = torch.tensor(fed, device=logits.device)
        return logits[rows], {layer: layers[i][rows] for i, layer in enumerate(capture)}

    def _fill(
        self,
        batch: StepBatch,
        caches: Sequence[PagedKVCache],
        ids: torch.Tensor,
        sizes: Sequence[int],
    ) -> None:
        """The host's side of a replay: copy the step's inputs into the batch's tensors.
        A padding token (past a window's end, or in an unused slot) feeds token 0 at its
        sequence's last position (0 in an unused slot) and writes a scratch row."""
        length, t, device = batch.rows.shape[1], batch.tokens, self.pool.device
        b = self.pool.block
        at = self.pool.scratch  # in no table: the padding's writes land nowhere read
        scratch = torch.arange(at * b, at * b + b, device=device)
        batch.rows.copy_(scratch.repeat(math.ceil(length / b))[:length].expand_as(batch.rows))
        fed = torch.zeros(batch.n, dtype=torch.int64, device=ids.device)
        positions = [0] * batch.n
        writes = torch.full((batch.n,), at * b, dtype=torch.int64, device=device)
        offset = 0
        for i, (c, k) in enumerate(zip(caches, sizes, strict=True)):
            visible = min(length, c.pos + k)
            batch.rows[i, :visible] = c.rows[:visible]
            fed[i * t : i * t + k] = ids[offset : offset + k]
            positions[i * t : (i + 1) * t] = [c.pos + min(j, k - 1) for j in range(t)]
            writes[i * t : i * t + k] = c.rows[c.pos : c.pos + k]
            offset += k
        batch.ids.copy_(fed)
        batch.positions.copy_(torch.tensor(positions))
        batch.write_rows.copy_(writes)


class _Captured:
    """One bucket's batch tensors and, on CUDA, its graph and output."""

    def __init__(
        self,
        model: WholeModel,
        pool: BlockPool,
        batch: int,
        tokens: int,
        rows: int,
        capture: tuple[int, ...],
        *,
        compile: bool,
        attention: str,
    ) -> None:
        self.model = model
        self.batch = StepBatch(pool, batch, rows, model._kv_sources(), tokens, attention)
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._new = 0
        self._run = (
            torch.compile(self._step, fullgraph=True, dynamic=False) if compile else self._step
        )
        self.compile_error: str | None = None

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, the captured layers' outputs [len(capture), B·T, hidden])."""
        m, batch = self.model, self.batch
        hidden = m.embed_rows(batch.ids)
        h, caps = m.run_layers(hidden, batch, batch, self.capture, ids=batch.ids)
        layers = torch.stack([caps[i] for i in self.capture]) if self.capture else h[None, :0]
        return m.head_logits(h), layers

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():  # one around the step, which holds none (docstring)
            try:
                return self._run()
            except torch._dynamo.exc.TorchDynamoException as exc:
                # Not traceable (the CPU's packed kernels are ctypes calls): run it as it
                # is. The step is the same either way, so the rows written twice are equal.
                self.compile_error = str(exc).splitlines()[0][:200]
                self._run = self._step
                return self._step()

    def run(self, graph_pool: object) -> tuple[torch.Tensor, torch.Tensor]:
        """graph_pool None: eagerly (the CPU, or capture off)."""
        if graph_pool is None:
            return self.forward()
        if self.graph is None:
            self._capture(graph_pool)
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        return self.out

    def _capture(self, graph_pool: object) -> None:
        # Warm-up on a side stream (allocator, cuBLAS handles, lazy tables), then capture.
        # Both compute this step's very K/V rows, so writing them early changes nothing.
        stream = torch.cuda.Stream(self.batch.ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=graph_pool):
            self.out = self.forward()
        self._new = 1

    def take_capture(self) -> int:
        new, self._new = self._new, 0
        return new
