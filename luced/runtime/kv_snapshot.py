"""The worker's KV snapshot verbs: ``kv_layout``, ``kv_export``, ``kv_import``.

A snapshot of this worker is one shared-memory region per KV tensor of its layers (see
the "KV snapshots" section of ``luced.ipc.frames``)::

    "k.{layer}", "v.{layer}"   [n_kv_heads, >= n, head_dim]   cache dtype (bfloat16 regions
                                                              are uint16 bits daemon-side)

for every layer that stores K/V: a KV-sharing layer (Gemma 4) reads its source layer's
tensors and has no region of its own, so nothing is copied twice; heads and head_dim
may differ per layer. A recurrent layer (Gated DeltaNet) keeps no rows but a state::

    "conv.{layer}"    [slots, kernel - 1, channels]       cache dtype   the state at
    "delta.{layer}"   [slots, heads, key_dim, value_dim]  float32       each cut

A state sums up every position before it, so it exists only where a forward stopped:
export needs n == the committed position and writes slot i from the state kept at
``cuts[i]`` (``forward`` ``keep_state`` kept it; the last cut is n); import reads one
slot, the state at n (the daemon picks the slot: a hybrid restores only at an entry's
cuts, the prefix cache's exact-cut mode) and keeps it, so the next snapshot may name n
as a cut again.

Export copies each layer's committed rows ``[0, n)`` from the cache into its region;
import replaces the cache of every shard by rows ``[0, n)`` of the regions (a longer
snapshot restores any shorter prefix) and sets the token history from ``tokens``. The
copies are ``copy_`` between the cache (on its device) and the torch view of the region
(host memory): device -> host and host -> device on a GPU, a memcpy on the CPU.

A worker on another host keeps its part in its own store instead (``store`` names the
entry; ``runtime/snapshot_store.py``): export fills fresh host arrays and keeps them, import
reads them back (refused, changing nothing, when the entry is gone or holds other
tokens), and ``kv_forget`` drops entries.

Both verbs resolve and check every region (names, shapes, dtypes, segment) before the
first copy, so a rejected request changes nothing. A copy that fails after that (an
import only) leaves the worker empty, as a ``reset`` does: never half a prefix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from luced.cache.layout import TensorSpec, tensor_specs
from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime.kv_blocks import PagedKVCache
from luced.runtime.kv_cache import ContextOverflow, RecurrentRollback
from luced.runtime.snapshot_store import Held, ShardSnapshots
from luced.runtime.state import Loaded, SequenceCache, WorkerError, WorkerState

# layer -> (its shard's cache, K view, V view) for K/V layers, (its shard's cache, conv
# view, delta view) for recurrent ones: the resolved regions of one request
_Resolved = dict[int, tuple[SequenceCache, torch.Tensor, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout(worker: WorkerState, req: F.KVLayout) -> F.KVLayoutReply:
    caches = worker.model("kv_layout").sequence(0).caches  # every sequence's are alike
    tensors, states = [], []
    for cache in caches:
        for layer in cache.stored:  # a KV-sharing layer has no tensors of its own
            for kind, t in (("k", cache.k[layer]), ("v", cache.v[layer])):
                tensors.append((f"{kind}.{layer}", t.shape[0], t.shape[2]))
        for name, (_, t) in _state_refs(cache).items():
            states.append((name, tuple(t.shape), dtype_name(t.dtype)))
    dtype = dtype_name(caches[0].dtype)
    return F.KVLayoutReply(
        tensors=tuple(tensors),
        dtype=dtype,  # type: ignore[arg-type]
        states=tuple(states),  # type: ignore[arg-type]
    )


@torch.inference_mode()  # the cache tensors are inference tensors: writes need this mode
def export(worker: WorkerState, req: F.KVExport) -> F.KVExportReply:
    m = worker.model("kv_export")
    state = m.sequence(req.sequence)
    n = req.position
    if n > state.position:
        raise WorkerError(f"kv_export of {n} positions, but the KV holds {state.position}")
    if n != state.position and state.recurrent:
        raise WorkerError(
            f"kv_export of {n} positions: the recurrent state is held at {state.position} only"
        )
    try:  # a paged-out block's rows are in the daemon's host tier, not here
        for cache in state.paged():
            cache.check_resident(n)
    except ValueError as exc:
        raise WorkerError(f"kv_export: {exc}") from None
    t0 = time.perf_counter()
    cuts = req.state_cuts
    held, store = None, None
    if req.store:  # this host's own store: fresh host arrays, kept once filled
        store = _store(worker)
        arrays = store.empty(n, len(cuts))
        tokens = np.asarray(state.tokens[:n], dtype=np.int32)
        held = Held(arrays, tokens, cuts)
        resolved = _bind(state.caches, _array_views(store.layout, arrays))
    else:
        resolved = _resolve(worker, m, state.caches, req.regions, n, len(cuts))
    try:  # every cut's state found before the first copy
        kept = {
            id(cache): [cache.state_at(c) for c in cuts]
            for cache in state.caches
            if cache.recurrent is not None
        }
    except RecurrentRollback as e:
        raise WorkerError(f"kv_export at cuts {list(cuts)}: {e}") from None
    for layer, (cache, a, b) in resolved.items():
        if cache.is_recurrent(layer):
            for slot, snap in enumerate(kept[id(cache)]):
                conv, delta = snap.states[layer]
                a[slot].copy_(conv)
                b[slot].copy_(delta)
        else:
            cache.export_rows(layer, n, a, b)
    if store is not None and held is not None:
        store.put(req.store, held)
    elapsed = time.perf_counter() - t0
    worker.busy_s += elapsed
    return F.KVExportReply(position=n, elapsed_us=int(elapsed * 1e6))


@torch.inference_mode()
def import_(worker: WorkerState, req: F.KVImport) -> F.KVImportReply:
    m = worker.model("kv_import")
    n = req.position
    if n > m.reply.kv_capacity:
        raise ContextOverflow(
            f"kv_import of {n} positions exceeds the KV capacity of {m.reply.kv_capacity} tokens"
        )
    t0 = time.perf_counter()
    state = m.sequence(req.sequence)
    ids = worker.tensor(req.tokens)[:n]
    if req.store:
        resolved = _stored(worker, state.caches, req.store, n, ids)
    else:
        resolved = _resolve(worker, m, state.caches, req.regions, n, 1)
    for cache in state.caches:
        if isinstance(cache, PagedKVCache):
            try:
                cache.check_import(n, req.blocks)
            except ValueError as exc:
                raise WorkerError(f"kv_import: {exc}") from None
    if n:
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= m.reply.vocab:
            raise WorkerError(f"token ids must lie in [0, {m.reply.vocab}), got [{lo}, {hi}]")
    history = ids.tolist()  # copied now: the daemon may reuse the region after the reply
    # Checked: from here on the old state goes.
    try:
        for cache in state.caches:
            mine = {layer: (a, b) for layer, (c, a, b) in resolved.items() if c is cache}
            rows = {layer: p for layer, p in mine.items() if not cache.is_recurrent(layer)}
            states = {layer: (a[0], b[0]) for layer, (a, b) in mine.items() if layer not in rows}
            states_in = states if cache.recurrent is not None else None
            if isinstance(cache, PagedKVCache):  # into the daemon's blocks
                cache.import_rows(n, rows, states_in, req.blocks)
            else:
                cache.import_rows(n, rows, states_in)
            if cache.recurrent is not None:
                cache.save_state()  # the restored cut stays a cut of the next snapshot
    except BaseException:
        state.clear()  # all shards empty, no history, no blocks: never half a prefix
        raise
    finally:
        state.drop_sampler()  # like reset: they belong to the old sequence
        if worker.draft is not None:
            worker.draft.samplers.pop(req.sequence, None)
    state.tokens[:] = history
    elapsed = time.perf_counter() - t0
    worker.busy_s += elapsed
    return F.KVImportReply(position=state.position, elapsed_us=int(elapsed * 1e6))


def forget(worker: WorkerState, req: F.KVForget) -> F.KVForgetReply:
    return F.KVForgetReply(dropped=_store(worker).forget(req.ids))


def snapshot_specs(worker: WorkerState) -> list[TensorSpec]:
    """This worker's part of a snapshot, as the daemon's ``KVTransfer`` describes it."""
    reply = layout(worker, F.KVLayout())
    return tensor_specs(reply.tensors, reply.dtype, reply.states)


def _store(worker: WorkerState) -> ShardSnapshots:
    if worker.snapshots is None:
        raise WorkerError(
            "this worker keeps no snapshot store (only a worker on another host does)"
        )
    return worker.snapshots


def _stored(
    worker: WorkerState, caches: list[SequenceCache], entry_id: str, n: int, ids: torch.Tensor
) -> _Resolved:
    """The store's entry as the caches' views, one state slot (cut n); refused, changing
    nothing, when this host does not hold it or it holds other tokens."""
    store = _store(worker)
    held = store.get(entry_id)
    if held is None:
        raise WorkerError(f"snapshot {entry_id} is not held on this host (evicted or lost)")
    if len(held.tokens) < n or not np.array_equal(held.tokens[:n], ids.numpy()):
        raise WorkerError(f"snapshot {entry_id} on this host holds other tokens")
    arrays = held.arrays
    if any(c.recurrent is not None for c in caches):
        if n not in held.cuts:
            raise WorkerError(f"snapshot {entry_id} keeps its state at {list(held.cuts)}, not {n}")
        slot = held.cuts.index(n)
        states = {s for c in caches for s in _state_refs(c)}
        arrays = {k: a[slot : slot + 1] if k in states else a for k, a in arrays.items()}
    return _bind(caches, _array_views(store.layout, arrays))


def _array_views(
    layout: Sequence[TensorSpec], arrays: dict[str, np.ndarray]
) -> dict[str, torch.Tensor]:
    """Torch views of host arrays named as the regions are (bfloat16 from its bits)."""
    bf16 = {s.name for s in layout if s.dtype == "bfloat16"}
    return {
        name: torch.from_numpy(a).view(torch.bfloat16) if name in bf16 else torch.from_numpy(a)
        for name, a in arrays.items()
    }


def _state_refs(cache: SequenceCache) -> dict[str, tuple[int, torch.Tensor]]:
    """Region name -> (layer, a reference tensor of its shape and dtype) for every recurrent
    layer of one shard's cache: "conv.l" and "delta.l" (the zero state's tensors have the
    shapes)."""
    rec = cache.recurrent
    if rec is None:
        return {}
    out = {}
    for layer in sorted(rec.shapes):
        conv, delta = rec.reference(layer)
        out[f"conv.{layer}"], out[f"delta.{layer}"] = (layer, conv), (layer, delta)
    return out


def _resolve(
    worker: WorkerState,
    m: Loaded,
    caches: list[SequenceCache],
    regions: Mapping[str, Region],
    n: int,
    slots: int,
) -> _Resolved:
    """Every layer's K and V region as torch views, all checked (no copy yet); a state
    region has ``slots`` states. `caches`: the sequence's, one per shard."""
    expected, refs = _expected(caches)
    missing, unknown = expected.keys() - regions.keys(), regions.keys() - expected.keys()
    if missing or unknown:
        a, b = m.reply.layers
        raise WorkerError(
            f"snapshot regions must name exactly this worker's tensors (layers [{a}, {b})): "
            f"missing {_sorted(missing)}, unknown {_sorted(unknown)}"
        )
    views: dict[str, torch.Tensor] = {}
    for name, region in regions.items():
        cache, layer = expected[name]
        if name in refs:
            want, dt = [slots, *refs[name].shape], dtype_name(refs[name].dtype)
            if region.dtype != dt or list(region.shape) != want:
                raise WorkerError(
                    f"region {name} must be {dt} {want}, got {region.dtype} {list(region.shape)}"
                )
            views[name] = worker.tensor(region)
            continue
        ref = cache.k[layer] if name[0] == "k" else cache.v[layer]
        heads, dim, dtype = ref.shape[0], ref.shape[2], dtype_name(cache.dtype)
        shape = region.shape
        if region.dtype != dtype or len(shape) != 3 or (shape[0], shape[2]) != (heads, dim):
            raise WorkerError(
                f"region {name} must be {dtype} [{heads}, >= {n}, {dim}], "
                f"got {region.dtype} {list(shape)}"
            )
        if shape[1] < n:
            raise WorkerError(f"region {name} holds {shape[1]} positions, fewer than {n}")
        views[name] = worker.tensor(region)  # attaches: a bad segment fails here, too
    return _bind(caches, views)


def _expected(
    caches: list[SequenceCache],
) -> tuple[dict[str, tuple[SequenceCache, int]], dict[str, torch.Tensor]]:
    """Region name -> (its shard's cache, layer) for every tensor of a snapshot of this
    worker, and each state's reference tensor (its exact shape and dtype)."""
    expected: dict[str, tuple[SequenceCache, int]] = {}
    refs: dict[str, torch.Tensor] = {}
    for cache in caches:
        for layer in cache.stored:
            expected[f"k.{layer}"] = expected[f"v.{layer}"] = (cache, layer)
        for name, (layer, ref) in _state_refs(cache).items():
            expected[name], refs[name] = (cache, layer), ref
    return expected, refs


def _bind(caches: list[SequenceCache], views: Mapping[str, torch.Tensor]) -> _Resolved:
    """The layer -> (cache, K or conv view, V or delta view) map of checked views."""
    out: _Resolved = {}
    for name, (cache, layer) in _expected(caches)[0].items():
        if name[0] == "k":
            out[layer] = (cache, views[name], views[f"v.{layer}"])
        elif name.startswith("conv."):
            out[layer] = (cache, views[name], views[f"delta.{layer}"])
    return out


def _sorted(names: set[str]) -> list[str]:
    """Names in layer order (k.2 before k.10)."""

    def key(name: str) -> tuple[int, str]:
        layer = name.partition(".")[2]
        return (int(layer) if layer.isdigit() else -1, name)

    return sorted(names, key=key)
