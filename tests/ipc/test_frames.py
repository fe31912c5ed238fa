"""Frames: every op round-trips; bad frames fail with errors that name the problem."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luced.ipc import codec
from luced.ipc import frames as F
from luced.ipc.regions import Region

SEG = "/luced-0123abcd-act"


def R(offset: int, shape: tuple[int, ...], dtype: str) -> Region:
    return Region(SEG, offset, shape, dtype)


def raw(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_samples_cover_every_op(sample_requests: dict, sample_replies: dict) -> None:
    assert set(sample_requests) == set(F.REQUESTS) == set(F.REPLIES) == set(sample_replies)
    assert set(F.REQUESTS) >= {"hello", "load", "forward", "truncate", "reset", "stats", "shutdown"}
    assert {"load_draft", "draft"} <= set(F.REQUESTS)


def test_every_request_and_reply_roundtrips(sample_requests: dict, sample_replies: dict) -> None:
    for i, (op, req) in enumerate(sample_requests.items()):
        payload = codec.encode_request(1000 + i, req)
        assert msgpack.unpackb(payload, raw=False)["op"] == op
        assert codec.decode_request(payload) == (1000 + i, req, None)
        rep = sample_replies[op]
        assert codec.decode_reply(codec.encode_reply(7, rep), op) == (7, rep)
    failed = codec.encode_reply(9, F.ErrorReply("out of memory"))
    assert msgpack.unpackb(failed, raw=False) == {"seq": 9, "ok": False, "error": "out of memory"}
    assert codec.decode_reply(failed, "forward") == (9, F.ErrorReply("out of memory"))


def test_wire_shape_of_a_forward(sample_requests: dict) -> None:
    wire = msgpack.unpackb(codec.encode_request(3, sample_requests["forward"]), raw=False)
    assert wire["op"] == "forward" and wire["seq"] == 3
    assert wire["tokens"] == {"segment": SEG, "offset": 960, "shape": [512], "dtype": "int32"}
    assert wire["capture"] == [1, 14, 27] and "hidden_in" not in wire  # a default
    span = wire["spans"][0]  # a span is a plain map on the wire
    assert span["sequence"] == 3 and span["n_out"] == 16
    assert span["sampling"]["seed"] == 2**40 and wire["spans"][1]["sampling"]["min_p"] is None
    assert wire["spans"][1]["moves"] == [[0, 1, 3, 0], [1, 4, 3, 2]]


SPAN_DEFAULTS = ("n_out", "verify", "q_row", "keep_state", "keep_block_states", "ring")


def test_a_decode_step_sends_only_what_differs_from_the_defaults() -> None:
    spans = tuple(F.Span(sequence=j, start=40, n=1, sampling={"seed": j}) for j in range(16))
    frame = F.Forward(
        spans, "sample", {"ids": R(64, (16,), "int32")}, tokens=R(128, (16,), "int32")
    )
    payload = codec.encode_request(4, frame)
    wire = msgpack.unpackb(payload, raw=False)
    assert wire["spans"][3] == {"sequence": 3, "start": 40, "n": 1, "sampling": {"seed": 3}}
    assert set(wire) == {"op", "seq", "spans", "want", "outputs", "tokens"}
    for name in (*SPAN_DEFAULTS, "moves", "pool", "hidden_in", "top_logprobs", "capture"):
        assert name.encode() not in payload
    assert codec.decode_request(payload) == (4, frame, None)  # the decoder fills them back
    reply = F.ForwardReply(positions=(41,) * 16, elapsed_us=8150)
    got = codec.encode_reply(4, reply)
    assert msgpack.unpackb(got, raw=False) == {
        "seq": 4,
        "ok": True,
        "positions": [41] * 16,
        "elapsed_us": 8150,
    }
    assert codec.decode_reply(got, "forward") == (4, reply)


def test_values_other_than_the_defaults_travel(sample_requests: dict) -> None:
    frame = sample_requests["forward"]
    wire = msgpack.unpackb(codec.encode_request(1, frame), raw=False)
    verify = wire["spans"][1]
    assert verify["verify"] is True and len(verify["moves"]) == 2
    assert set(SPAN_DEFAULTS) - set(verify) == {"q_row", "keep_state", "keep_block_states"}
    pooled = F.Span(sequence=1, start=0, n=3, n_out=0, q_row=2, keep_state=True, pool="first")
    wired = pooled.to_wire()
    assert wired == {
        "sequence": 1,
        "start": 0,
        "n": 3,
        "n_out": 0,
        "q_row": 2,
        "keep_state": True,
        "pool": "first",
    }
    assert F.Span.from_wire(wired) == pooled
    reply = F.ForwardReply(positions=(3,), elapsed_us=0, accepted=(0,), moe_fallbacks=2)
    assert codec.decode_reply(codec.encode_reply(2, reply), "forward") == (2, reply)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("verify", 1, r"spans\[0\]: Span: verify: expected bool, got int 1"),
        ("n_out", 2, r"n_out must be 0, 1 or n \(4\), got 2"),
        ("n_out", None, "Span: n_out: expected int, got NoneType"),
        ("ring", {"segment": SEG}, r"spans\[0\]: Span: ring: "),
        ("pool", "max", r"pool: expected one of \['', 'sum', 'first', 'last'\]"),
        ("moves", [[0, 1]], r"Span: moves\[0\]: expected 4 items, got 2"),
        ("sampling", {"seed": 1.0}, "sampling.seed must be an int"),
    ],
)
def test_a_bad_value_of_a_defaulted_field_is_refused(field: str, value: object, match: str) -> None:
    wire = msgpack.unpackb(codec.encode_request(6, forward()), raw=False)
    wire["spans"][0][field] = value
    with pytest.raises(F.FrameError, match=match) as info:
        codec.decode_request(raw(wire))
    assert info.value.seq == 6
    del wire["spans"][0]["n"]  # no default: it must travel
    with pytest.raises(F.FrameError, match=r"Span: missing field\(s\) \['n'\]"):
        codec.decode_request(raw(wire))


def test_a_sampling_map_is_checked_with_its_types() -> None:
    # A map checked once passes without a second check; one equal to it with other value
    # types is checked afresh.
    span(sampling={"seed": 5, "top_k": 1, "temperature": 0})
    for bad, match in [
        ({"seed": 5.0, "top_k": 1, "temperature": 0}, "sampling.seed must be an int"),
        ({"seed": 5, "top_k": 1.0, "temperature": 0}, "sampling.top_k must be an int"),
    ]:
        with pytest.raises(F.FrameError, match=match):
            span(sampling=bad)
        with pytest.raises(F.FrameError, match=match):
            span(sampling=bad)


def test_hello_sends_its_protocol_version() -> None:
    # hello's defaults travel: a peer must read the version it was built with
    wire = msgpack.unpackb(codec.encode_request(1, F.Hello(instance="ab")), raw=False)
    assert wire == {
        "op": "hello",
        "seq": 1,
        "instance": "ab",
        "protocol": F.PROTOCOL_VERSION,
        "files": {},
    }


def test_construction_normalises_types() -> None:
    f = F.Truncate(position=np.int64(5))
    assert type(f.position) is int
    load = F.LoadReply(30, 576, 49152, [0, 30], "float32", 10, 2)
    assert load.layers == (0, 30) and type(load.load_s) is float
    hidden = R(64, (1, 8), "float16").to_wire()  # a plain map, as msgpack delivers it
    span = {"sequence": 0, "start": 0, "n": 1}  # a span, as msgpack delivers it
    fw = F.Forward([span], "hidden", {"hidden": hidden}, tokens=R(128, (1,), "int32"))
    assert isinstance(fw.outputs["hidden"], Region) and isinstance(fw.spans[0], F.Span)
    assert fw.spans[0].n_out == 1


RING = R(8192, (16, 2, 8), "float32")
MOVES = ((0, 2, 5, 0), (1, 0, 5, 1))  # block 2 out to record 0, block 0 in from record 1


def span(**kw: object) -> F.Span:
    base: dict[str, object] = {"sequence": 0, "start": 0, "n": 4}
    base.update(kw)
    return F.Span(**base)  # type: ignore[arg-type]


def forward(**kw: object) -> F.Forward:
    base: dict[str, object] = {
        "spans": (span(),),
        "want": "sample",
        "outputs": {"ids": R(64, (4,), "int32")},
        "tokens": R(128, (8,), "int32"),
    }
    base.update(kw)
    return F.Forward(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n": "4"}, r"Span: n: expected int, got str"),
        ({"n": True}, r"n: expected int, got bool"),
        ({"start": 1.0}, r"start: expected int, got float"),
        ({"n": 0}, "n >= 1"),
        ({"sequence": -1}, "sequence, start, q_row >= 0"),
        ({"n_out": 2}, r"n_out must be 0, 1 or n \(4\), got 2"),
        ({"verify": True}, "a verify span feeds n >= 2 tokens with n_out = n"),
        ({"verify": True, "n": 1, "n_out": 1}, "verify span feeds n >= 2"),
        ({"ring": R(256, (2, 1, 16), "float32")}, "ring holds 2 positions, fewer than 4"),
        ({"sampling": {"temp": 1.0}}, r"unknown sampling key\(s\) \['temp'\]"),
        ({"sampling": {"temperature": float("nan")}}, "sampling.temperature must be finite"),
        ({"sampling": {"seed": 1.5}}, "sampling.seed must be an int"),
        ({"sampling": {"top_p": "0.9"}}, r"sampling\.top_p: expected int \| float \| dict"),
        ({"sampling": {"logit_bias": {"7": 101}}}, r"sampling\.logit_bias of token 7 must be in"),
        ({"sampling": {"logit_bias": {"7": "1"}}}, r"sampling\.logit_bias: expected int"),
        ({"pool": "sum"}, "a pooling span samples nothing: n_out must be 0, got 1"),
        ({"pool": "max", "n_out": 0}, r"pool: expected one of \['', 'sum', 'first', 'last'\]"),
        ({"blocks": (3,)}, "blocks and copies need a table length >= 1, got 0"),
        ({"table": -1}, "need a table length >= 1, got -1"),
        ({"blocks": (3, 4), "table": 1}, "2 blocks appended to a table of 1"),
        ({"blocks": (3, 3), "table": 2}, r"new ones distinct, got \[3, 3\]"),
        ({"blocks": (-1,), "table": 1}, "pool blocks must be >= 0"),
        ({"copies": ((0, 1, 5),), "blocks": (5,), "table": 2}, "new ones distinct"),
        ({"copies": ((1, 1, 5),), "blocks": (6,), "table": 2}, "blocks of the table before"),
        ({"copies": ((0, 1, 5), (0, 2, 6)), "table": 2}, "a logical block is copied twice"),
        ({"copies": ((0, 1),), "table": 2}, r"copies\[0\]: expected 3 items"),
        ({"moves": ((0, 0, 1, 0),)}, r"moves need a block table \(table >= 1\)"),
        (
            {"moves": ((2, 0, 1, 0),), "table": 2},
            r"a move is \(0 out \| 1 in, .* got \[2, 0, 1, 0\]",
        ),
        (
            {"moves": ((1, 1, 4, 0),), "blocks": (5,), "table": 2},
            "logical block of the table before",
        ),
        ({"moves": ((0, 0, 1, -1),), "table": 2}, "record >= 0"),
        ({"moves": ((0, 0, 1),), "table": 2}, r"moves\[0\]: expected 4 items"),
        ({"kv_scores": R(64, (3, 8), "float32")}, r"kv_scores must be float32 \[2, blocks\]"),
    ],
)
def test_span_validation(kw: dict, match: str) -> None:
    with pytest.raises(F.FrameError, match=match):
        span(**kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"spans": ()}, "at least one span"),
        ({"spans": (span(), span())}, r"a sequence appears twice: \[0, 0\]"),
        ({"spans": ({"sequence": 0, "start": 0},)}, r"spans\[0\]: Span: missing field"),
        (
            {"want": "beam"},
            r"want: expected one of \['sample', 'logits', 'hidden'\]",
        ),
        ({"tokens": None}, "one of tokens / hidden_in must be given"),
        ({"tokens": R(128, (3,), "int32")}, r"tokens must be int32 \[>= 4\]"),
        ({"tokens": R(128, (8,), "int64")}, "tokens must be int32"),
        ({"outputs": {"ids": {"segment": SEG}}}, r"outputs\.ids: region keys: missing"),
        ({"outputs": {}}, r"needs outputs \['ids'\]"),
        ({"outputs": {"ids": R(64, (4,), "int32"), "x": R(128, (1,), "int32")}}, "got"),
        ({"outputs": {"ids": R(64, (4,), "float32")}}, "outputs.ids must be int32"),
        (
            {"spans": (span(n_out=4),), "outputs": {"ids": R(64, (3,), "int32")}},
            ">= 4 rows",
        ),
        ({"top_logprobs": 2}, r"needs outputs \['ids', 'topk_ids', 'topk_logprobs'\]"),
        (
            {
                "top_logprobs": 3,
                "outputs": {
                    "ids": R(64, (1,), "int32"),
                    "topk_ids": R(64, (1, 3), "int32"),
                    "topk_logprobs": R(128, (1, 2), "float32"),
                },
            },
            "outputs.topk_logprobs needs 3 columns, got 2",
        ),
        ({"want": "logits", "outputs": {"logits": R(64, (1, 9), "float16")}}, "logits must be"),
        ({"capture": (3,)}, "capture layers given without a ring"),
        ({"spans": (span(ring=RING),)}, "ring given without capture"),
        ({"capture": (3, 3), "spans": (span(ring=R(256, (8, 2, 16), "float32")),)}, "distinct"),
        (
            {"capture": (3, 5), "spans": (span(ring=R(256, (8, 3, 16), "float32")),)},
            r"ring must be float",
        ),
        (
            {"capture": (0, 2), "spans": (span(ring=RING), span(sequence=1))},
            "every span names its ring",
        ),
        ({"allowed": R(256, (1, 2), "uint32")}, r"allowed must be int32 \[>= 1, words\]"),
        ({"allowed": R(256, (3, 2), "int32"), "spans": (span(n_out=4),)}, ">= 4, words"),
        (
            {
                "allowed": R(256, (1, 2), "int32"),
                "want": "logits",
                "outputs": {"logits": R(64, (1, 9), "float32")},
            },
            'allowed is only for want="sample"',
        ),
        (
            {"spans": (span(n_out=4, verify=True),), "outputs": {"ids": R(64, (4,), "int32")}},
            r"draft_probs must be float32 \[>= 3, vocab\], got none",
        ),
        ({"draft_probs": R(64, (4, 9), "float32")}, "draft_probs without a verify span"),
        (
            {
                "spans": (span(n_out=4, verify=True),),
                "want": "logits",
                "outputs": {"logits": R(64, (4, 9), "float32")},
                "draft_probs": R(64, (4, 9), "float32"),
            },
            'a verify span needs want="sample"',
        ),
        (
            {"spans": (span(n_out=0, pool="sum"),), "outputs": {"ids": R(64, (0,), "int32")}},
            r"needs outputs \['embeddings', 'ids'\]",
        ),
        (
            {
                "spans": (span(n_out=0, pool="sum"), span(sequence=1, n_out=0, pool="last")),
                "outputs": {"ids": R(64, (0,), "int32"), "embeddings": R(64, (1, 8), "float32")},
            },
            r"outputs.embeddings must be float32 with 2 dim\(s\) and >= 2 rows",
        ),
        (
            {
                "spans": (span(n_out=0, pool="first"),),
                "want": "hidden",
                "outputs": {"hidden": R(64, (4, 8), "float32")},
            },
            "a pooling span goes to the last shard",
        ),
        (
            {"spans": (span(moves=((0, 0, 1, 0),), table=1),)},
            "a span with moves needs kv_host",
        ),
        ({"kv_host": R(64, (8,), "uint8")}, r"kv_host must be uint8 \[records, bytes\]"),
    ],
)
def test_forward_validation(kw: dict, match: str) -> None:
    with pytest.raises(F.FrameError, match=match):
        forward(**kw)


def test_forward_accepts_the_intended_shapes() -> None:
    h_in, h_out = R(64, (8, 16), "bfloat16"), R(512, (4, 16), "bfloat16")
    h = forward(tokens=None, hidden_in=h_in, want="hidden", outputs={"hidden": h_out})
    assert h.n_out == 1 and h.n_tokens == 4
    lg = forward(
        spans=(span(n_out=4),), want="logits", outputs={"logits": R(64, (4, 50), "float32")}
    )
    assert lg.n_out == 4
    ring = forward(capture=(0, 2), spans=(span(ring=R(1024, (16, 2, 8), "float32")),))
    assert ring.capture == (0, 2)
    both = forward(hidden_in=h_in)  # a later shard: tokens are only its sampler's history
    assert both.tokens is not None and both.hidden_in is not None
    masked = forward(allowed=R(256, (64, 2), "int32"))  # the region may hold more rows
    assert masked.allowed is not None and masked.allowed.shape == (64, 2)
    feed = forward(spans=(span(n_out=0),))  # a prompt chunk before the last: no rows out
    assert feed.n_out == 0
    two = forward(
        spans=(span(n=3, n_out=0, moves=MOVES, table=3), span(sequence=1, start=9, n=5, n_out=5)),
        outputs={"ids": R(64, (5,), "int32")},
        tokens=R(128, (8,), "int32"),
        kv_host=R(4096, (2, 512), "uint8"),
    )
    back = F.Forward.from_wire(two.to_wire())
    assert back == two and back.spans[0].moves == MOVES
    assert (two.n_tokens, two.n_out) == (8, 5)
    embeds = forward(  # an embedding's span beside a decode token: one pooled row
        spans=(span(n_out=0, pool="sum"), span(sequence=1, start=9, n=1)),
        outputs={"ids": R(64, (1,), "int32"), "embeddings": R(128, (4, 16), "float32")},
    )
    assert (embeds.n_out, embeds.n_pooled) == (1, 1)
    assert F.Forward.from_wire(embeds.to_wire()).spans[0].pool == "sum"


def draft_block(**kw: object) -> F.DraftBlock:
    base: dict[str, object] = {
        "ring": R(4096, (64, 2, 16), "float32"),
        "committed": 10,
        "anchor": 7,
        "outputs": {"ids": R(64, (4,), "int32")},
        "block_size": 4,
    }
    base.update(kw)
    return F.DraftBlock(**base)  # type: ignore[arg-type]


SAMPLED_OUT = {"ids": R(64, (4,), "int32"), "probs": R(128, (3, 50), "float32")}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"committed": 0}, "need committed >= 1"),
        ({"anchor": -1}, "anchor >= 0"),
        ({"ctx_window": 0}, "ctx_window >= 1"),
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"mask_token_id": -2}, "mask_token_id must be >= 0"),
        ({"ring": R(4096, (64, 32), "float32")}, r"ring must be float \[ring_cap, n_capture"),
        ({"ring": R(4096, (64, 2, 16), "int32")}, "ring must be float"),
        ({"outputs": {}}, r"outputs must be \['ids'\]"),
        ({"outputs": SAMPLED_OUT}, r"outputs must be \['ids'\] \(probs iff temperature > 0\)"),
        ({"sampling": {"temperature": 0.5}}, r"outputs must be \['ids', 'probs'\]"),
        ({"sampling": {"seed": 1}}, r"\['ids', 'probs'\]"),  # temperature absent = 1
        ({"outputs": {"ids": R(64, (3,), "int32")}}, r"outputs.ids must be int32 .* >= 4 rows"),
        ({"outputs": {"ids": R(64, (4,), "int64")}}, "outputs.ids must be int32"),
        (
            {
                "sampling": {"temperature": 1.0},
                "outputs": {**SAMPLED_OUT, "probs": R(128, (2, 50), "float32")},
            },
            r"outputs.probs must be float32 with 2 dim\(s\) and >= 3 rows",
        ),
        ({"sampling": {"temp": 1.0}}, r"unknown sampling key\(s\) \['temp'\]"),
    ],
)
def test_draft_validation(kw: dict, match: str) -> None:
    with pytest.raises(F.FrameError, match=match):
        draft_block(**kw)


def test_draft_accepts_the_intended_shapes() -> None:
    assert not draft_block().sampled
    assert not draft_block(sampling={"temperature": 0}).sampled  # greedy: ids only
    sampled = draft_block(sampling={"temperature": 0.6, "top_k": 5}, outputs=SAMPLED_OUT)
    assert sampled.sampled
    # block_size and mask token left to the draft config: ids rows are checked by the worker
    loose = draft_block(block_size=None, outputs={"ids": R(64, (2,), "int32")})
    assert loose.block_size is None and loose.mask_token_id is None
    with pytest.raises(F.FrameError, match="must not be empty"):
        F.LoadDraft(path="d.gguf", dtype="float32", device="cpu", target="")
    with pytest.raises(F.FrameError, match="dtype: expected one of"):
        F.LoadDraft(path="d.gguf", dtype="float8", device="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layers": (3, 3)}, "0 <= a < b"),
        ({"layers": (0, 1, 2)}, "layers: expected 2 items, got 3"),
        ({"dtype": "float8"}, "dtype: expected one of"),
        ({"devices": ()}, "devices is empty"),
        ({"devices": ("cpu", "cpu:1")}, "2 devices need 1 device_splits, got 0"),
        ({"devices": ("cpu", "cpu:1"), "device_splits": (10,)}, "increase strictly inside"),
        ({"kv_capacity": 0}, "kv_capacity must be >= 1"),
        ({"owns_head": 1}, "owns_head: expected bool, got int"),
        ({"kv_block": -1}, "kv_block must be >= 0"),
        ({"kv_block": 16}, r"kv_blocks \(the pool's blocks, 0\) comes with kv_block \(16\)"),
        ({"kv_blocks": 8}, "comes with kv_block"),
        ({"kv_scored": True}, "kv_scored keeps block keys: it needs kv_block"),
    ],
)
def test_load_validation(kw: dict, match: str) -> None:
    base = dict(
        model="m.gguf",
        layers=(0, 10),
        dtype="float32",
        devices=("cpu",),
        kv_capacity=64,
        owns_embed=True,
        owns_head=True,
    )
    base.update(kw)
    with pytest.raises(F.FrameError, match=match):
        F.Load(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"source": 2}, "another sequence"),
        ({"source": -1}, "another sequence"),
        ({"position": -1}, "position must be >= 0"),
        ({"sequence": -3}, "sequence must be >= 0"),
    ],
)
def test_kv_share_validation(kw: dict, match: str) -> None:
    with pytest.raises(F.FrameError, match=match):
        F.KVShare(**{"sequence": 2, "source": 1, "position": 32, **kw})


def test_wire_shape_of_kv_page(sample_requests: dict) -> None:
    wire = msgpack.unpackb(codec.encode_request(4, sample_requests["kv_page"]), raw=False)
    assert wire["op"] == "kv_page" and wire["sequence"] == 70
    assert wire["moves"] == [[0, 3, 12, 5], [0, 4, 2, 6]]
    assert wire["kv_host"] == {"segment": SEG, "offset": 64, "shape": [16, 4096], "dtype": "uint8"}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"moves": ()}, "moves and states must not both be empty"),
        ({"moves": ((4, 1, 1, 1),)}, r"a move is \(0 out \| 1 in \| 2 save.*got \[4, 1, 1, 1\]"),
        ({"moves": ((0, 1, -1, 1),)}, r"got \[0, 1, -1, 1\]"),
        ({"moves": ((2, 1, -1, 1),)}, r"got \[2, 1, -1, 1\]"),
        ({"moves": ((3, 1, 0, 1),)}, r"\(3 adopt, logical block, -1, record\), got \[3, 1, 0, 1\]"),
        ({"moves": ((3, 1, -2, 1),)}, r"got \[3, 1, -2, 1\]"),
        ({"tokens": (1, 2)}, "tokens come with adopt moves only"),
        ({"moves": ((0, 1, 1),)}, "expected 4 items, got 3"),
        ({"kv_host": Region(SEG, 64, (16,), "uint8")}, r"kv_host must be uint8 \[records, bytes\]"),
        ({"sequence": -1}, "sequence must be >= 0"),
    ],
)
def test_kv_page_validation(kw: dict, match: str) -> None:
    base = {"sequence": 70, "moves": ((0, 1, 2, 3),), "kv_host": Region(SEG, 64, (4, 64), "uint8")}
    with pytest.raises(F.FrameError, match=match):
        F.KVPage(**{**base, **kw})


def test_kv_page_saves_and_adopts() -> None:
    host = Region(SEG, 64, (4, 64), "uint8")
    saved = F.KVPage(sequence=3, moves=((2, 0, 5, 1), (2, 1, 6, 2)), kv_host=host)
    assert saved.tokens == ()
    adopted = F.KVPage(sequence=4, moves=((3, 0, -1, 1),), kv_host=host, tokens=(7,) * 16)
    assert adopted.moves == ((3, 0, -1, 1),) and len(adopted.tokens) == 16


STATES = Region(SEG, 4096, (2, 512), "uint8")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"states": ((2, 16, 0),)}, r"a state is \(0 save \| 1 load.*got \[2, 16, 0\]"),
        ({"states": ((0, -16, 0),)}, r"got \[0, -16, 0\]"),
        ({"states": ((1, 16, 0), (1, 16, 1))}, "a frame loads one state at most"),
        ({"states": ((1, 16, 0),), "moves": ((2, 0, 5, 1),)}, "loaded with adopt moves only"),
        ({"kv_states": None}, "kv_states comes with states, and only with them"),
        ({"states": ()}, "kv_states comes with states, and only with them"),
        ({"kv_states": Region(SEG, 64, (16,), "uint8")}, r"kv_states must be uint8 \[records"),
    ],
)
def test_kv_page_state_validation(kw: dict, match: str) -> None:
    base = {
        "sequence": 7,
        "moves": ((3, 0, -1, 1),),
        "kv_host": Region(SEG, 64, (4, 64), "uint8"),
        "tokens": (5,) * 16,
        "states": ((1, 16, 0),),
        "kv_states": STATES,
    }
    with pytest.raises(F.FrameError, match=match):
        F.KVPage(**{**base, **kw})


def test_kv_page_saves_and_loads_states() -> None:
    """A hybrid's state records: saves alone (no moves), a load beside its adopts."""
    host = Region(SEG, 64, (4, 64), "uint8")
    saved = F.KVPage(sequence=3, moves=(), kv_host=host, states=((0, 32, 1),), kv_states=STATES)
    assert saved.states == ((0, 32, 1),)
    wire = msgpack.unpackb(codec.encode_request(4, saved), raw=False)
    assert wire["states"] == [[0, 32, 1]] and wire["kv_states"]["shape"] == [2, 512]
    loaded = F.KVPage(
        sequence=4,
        moves=((3, 0, -1, 1), (3, 1, -1, 2)),
        kv_host=host,
        tokens=(7,) * 32,
        states=((1, 32, 0),),
        kv_states=STATES,
    )
    assert loaded.states == ((1, 32, 0),)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"part": "../x"}, "part must be a plain directory name"),
        ({"model": ""}, "model must be a plain directory name"),
        ({"action": "list", "records": (1,)}, "list takes no blocks, records or kv_host"),
        (
            {
                "action": "clear",
                "kv_host": None,
                "records": (),
                "parents": b"",
                "tokens": b"",
                "keys": bytes(16),
            },
            "clear takes no blocks",
        ),
        ({"keys": bytes(16)}, "write takes records and parents and tokens only"),
        ({"records": ()}, "write takes records"),
        ({"kv_host": Region(SEG, 64, (16,), "uint8")}, r"kv_host must be uint8 \[records, bytes\]"),
        ({"kv_host": None}, r"kv_host must be uint8 \[records, bytes\], got none"),
        ({"records": (1, 1)}, r"records must be distinct and >= 0, got \[1, 1\]"),
        ({"parents": bytes(15)}, "1 records take 16 bytes of keys, got 15"),
        ({"tokens": b"12345"}, "tokens must be 1 blocks of int32 ids"),
        ({"after": bytes(3)}, "after must be a key of 16 bytes"),
    ],
)
def test_kv_files_validation(kw: dict, match: str) -> None:
    base = {
        "action": "write",
        "model": "m",
        "part": "b16-f32-L0-2",
        "kv_host": Region(SEG, 64, (4, 64), "uint8"),
        "records": (1,),
        "parents": bytes(16),
        "tokens": bytes(64),
    }
    with pytest.raises(F.FrameError, match=match):
        F.KVFiles(**{**base, **kw})


def test_kv_files_reads_name_their_keys() -> None:
    host = Region(SEG, 64, (4, 64), "uint8")
    read = F.KVFiles(action="read", model="m", part="p", kv_host=host, records=(0, 2),
                     keys=bytes(32))  # fmt: skip
    assert read.records == (0, 2) and read.parents == b""
    assert F.KVFiles(action="list", model="m", part="p", after=bytes(16)).kv_host is None
    with pytest.raises(F.FrameError, match="read takes records and keys only"):
        F.KVFiles(action="read", model="m", part="p", kv_host=host, records=(0,),
                  keys=bytes(16), parents=bytes(16))  # fmt: skip


def test_snapshots_kept_by_a_worker_are_named_by_id() -> None:
    tokens = Region("/luced-x-arena", 64, (8,), "int32")
    kept = F.KVImport(position=8, regions={}, tokens=tokens, store="3f9a0c12d4e1")
    assert kept.store == "3f9a0c12d4e1"
    k = Region("/luced-x-arena", 128, (1, 8, 4), "float32")
    with pytest.raises(F.FrameError, match="regions must be empty when store"):
        F.KVExport(position=8, regions={"k.0": k}, store="3f9a")
    with pytest.raises(F.FrameError, match="store must be a snapshot id"):
        F.KVExport(position=8, regions={}, store="../x")
    with pytest.raises(F.FrameError, match="regions is empty"):
        F.KVExport(position=8, regions={})
    with pytest.raises(F.FrameError, match="ids must be snapshot ids"):
        F.KVForget(ids=("3f9a", "a b"))
    with pytest.raises(F.FrameError, match=r"blocks must be distinct pool blocks >= 0"):
        F.KVImport(position=8, regions={}, tokens=tokens, store="3f9a", blocks=(2, 2))


def test_decode_errors_name_the_problem_and_keep_the_seq(sample_requests: dict) -> None:
    good = msgpack.unpackb(codec.encode_request(5, sample_requests["truncate"]), raw=False)
    cases = [
        ({**good, "position": "x"}, "truncate request: position: expected int, got str"),
        ({k: v for k, v in good.items() if k != "position"}, r"missing field\(s\) \['position'\]"),
        ({**good, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
        ({**good, "op": "fly"}, "unknown op 'fly'"),
        ({**good, "op": None}, "unknown op None"),
    ]
    for obj, match in cases:
        with pytest.raises(F.FrameError, match=match) as info:
            codec.decode_request(raw(obj))
        assert info.value.seq == 5
    for seq in (-1, "5", None, 2**64 - 1):
        with pytest.raises(F.FrameError, match="seq must be an int") as info:
            codec.decode_request(raw({**good, "seq": seq}))
        assert info.value.seq is None


def test_reply_envelope_errors() -> None:
    with pytest.raises(F.FrameError, match="'ok' must be true or false"):
        codec.decode_reply(raw({"seq": 1, "ok": 1, "position": 3}), "truncate")
    with pytest.raises(F.FrameError, match="exactly a string 'error'"):
        codec.decode_reply(raw({"seq": 1, "ok": False}), "truncate")
    with pytest.raises(F.FrameError, match=r"truncate reply: missing field\(s\)"):
        codec.decode_reply(raw({"seq": 1, "ok": True}), "truncate")


def test_protocol_version_mismatch_is_clear() -> None:
    # Checked before any other field: a newer peer may have renamed them all.
    payload = raw({"op": "hello", "seq": 1, "protocol": 999, "renamed": "x"})
    with pytest.raises(
        F.ProtocolVersionError, match=f"peer speaks 999, this side speaks {F.PROTOCOL_VERSION}"
    ):
        codec.decode_request(payload)
    reply = raw({"seq": 1, "ok": True, "protocol": F.PROTOCOL_VERSION + 1, "pid": 1})
    with pytest.raises(F.ProtocolVersionError, match="protocol version mismatch"):
        codec.decode_reply(reply, "hello")
    with pytest.raises(F.ProtocolVersionError):
        F.Hello(instance="x", protocol=F.PROTOCOL_VERSION + 1)
    with pytest.raises(F.ProtocolVersionError):  # no version at all is a mismatch too
        codec.decode_request(raw({"op": "hello", "seq": 1, "instance": "x"}))


def test_unencodable_values_fail_at_the_sender() -> None:
    with pytest.raises(F.FrameError, match="outside the 64-bit integer range"):
        F.Truncate(position=2**64)
    with pytest.raises(F.FrameError, match="seq must be an int"):
        codec.encode_request(2**64, F.Reset())
    with pytest.raises(F.FrameError, match="seq must be an int"):
        codec.encode_reply(-1, F.ResetReply())


def test_oversized_frames_are_refused() -> None:
    huge = F.Load("m" * (codec.MAX_FRAME_BYTES + 1), (0, 1), "float32", ("cpu",), 1, True, True)
    with pytest.raises(codec.FrameTooLargeError, match="exceeds MAX_FRAME_BYTES=16777216"):
        codec.encode_request(1, huge)
    with pytest.raises(codec.FrameTooLargeError, match="exceeds"):
        codec.decode_request(bytes(codec.MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "malformed msgpack"),
        (b"\xc1", "malformed msgpack"),  # a byte msgpack never uses
        (raw({"op": "reset", "seq": 1})[:-3], "malformed msgpack"),  # truncated
        (raw({"op": "reset", "seq": 1}) + b"\x00", "malformed msgpack"),  # trailing bytes
        (b"\x81\xa2op\xa3\xff\xfe\xfd", "malformed msgpack"),  # invalid UTF-8 string
        (raw({1: 2}), "malformed msgpack"),  # non-string map key
        (raw([1, 2]), "must be a msgpack map, got list"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "must be a msgpack map, got ExtType"),
    ],
)
def test_malformed_msgpack(payload: bytes, match: str) -> None:
    with pytest.raises(F.FrameError, match=match):
        codec.decode_request(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_frame_error(payload: bytes) -> None:
    with contextlib.suppress(F.FrameError):  # anything else is a bug
        codec.decode_request(payload)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
_field_names = {f.name for cls in F.REQUESTS.values() for f in dataclasses.fields(cls)}
_keys = st.sampled_from(sorted(_field_names | {"op", "seq", "segment", "offset", "bogus"}))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values), st.sampled_from(sorted(F.REQUESTS)))
def test_random_maps_only_raise_frame_error(obj: dict, op: str) -> None:
    obj = {"op": op, "seq": 1, **obj}
    with contextlib.suppress(F.FrameError):
        codec.decode_request(raw(obj))


def test_frames_are_frozen(sample_requests: dict) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample_requests["truncate"].position = 3


def test_ipc_uses_no_pickle_and_no_torch() -> None:
    root = Path(F.__file__).parent
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "torch"}
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & banned, f"{path.name} imports {names & banned}"
    code = (
        "import sys, luced.ipc.shm, luced.ipc.regions, luced.ipc.frames, luced.ipc.channel; "
        "bad = {'torch', 'pickle'} & set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # pickle may be pulled in by the standard library itself; torch never.
    assert "torch" not in out.stdout


def test_expert_mix_shapes_must_agree() -> None:
    x, ids, w = R(4096, (3, 64), "float32"), R(8192, (3, 2), "int32"), R(8256, (3, 2), "float32")
    F.ExpertMix(layer=1, x=x, ids=ids, weights=w)
    with pytest.raises(F.FrameError, match="same"):
        F.ExpertMix(layer=1, x=x, ids=ids, weights=R(8256, (3, 3), "float32"))
    with pytest.raises(F.FrameError, match="rows"):
        F.ExpertMix(layer=1, x=R(4096, (4, 64), "float32"), ids=ids, weights=w)
    with pytest.raises(F.FrameError, match="int32"):
        F.ExpertMix(layer=1, x=x, ids=R(8192, (3, 2), "int64"), weights=w)
    with pytest.raises(F.FrameError, match="hot must be"):
        F.LoadExperts(model="m.gguf", dtype="float32", device="cpu", hot=-1)
