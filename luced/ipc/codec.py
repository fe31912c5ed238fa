"""The msgpack codec of the frames in ``frames.py``: typed frame <-> payload bytes.

A payload is one msgpack map (``use_bin_type=True`` / ``raw=False``, strict types, no
extension types, no pickle) of at most ``MAX_FRAME_BYTES``; ``channel.py`` adds the length
prefix. Decoding checks the envelope (``op``, ``seq``, ``ok``) here and the fields in the
frame classes, so a malformed payload is a ``FrameError`` carrying ``seq`` when readable.

A request may carry a ``Carry`` (``frames/remote.py``) under the envelope key "carry", and
its reply the bytes of the regions it got under "carried" (a list, in the carry's order).
"""

from __future__ import annotations

from typing import Any

import msgpack

from luced.ipc.frames import REPLIES, REQUESTS, Carry, ErrorReply, Reply, Request
from luced.ipc.typed import FrameError

MAX_FRAME_BYTES = 16 * 1024 * 1024
_SEQ_MAX = 2**63 - 1


class FrameTooLargeError(FrameError):
    """A frame exceeds ``MAX_FRAME_BYTES``."""


def _pack(obj: dict[str, Any]) -> bytes:
    try:
        data = msgpack.packb(obj, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:  # fields were checked: a bug here
        raise FrameError(f"cannot encode frame as msgpack: {e}", obj.get("seq")) from None
    if len(data) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(
            f"frame of {len(data)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES} "
            "(bulk data belongs in shared memory)",
            obj.get("seq"),
        )
    return data


def _unpack(payload: bytes) -> dict[str, Any]:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(
            f"frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}"
        )
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise FrameError(f"malformed msgpack frame ({len(payload)} bytes): {e}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"a frame must be a msgpack map, got {type(obj).__name__}")
    return obj


def _seq(obj: dict[str, Any]) -> int:
    seq = obj.get("seq")
    if type(seq) is not int or not 0 <= seq <= _SEQ_MAX:
        raise FrameError(f"frame seq must be an int in [0, 2**63), got {seq!r}")
    return seq


def encode_request(seq: int, req: Request, carry: Carry | None = None) -> bytes:
    """The msgpack payload of ``req`` (no length prefix), with its carry when not empty."""
    _seq({"seq": seq})
    obj = {"op": req.OP, "seq": seq, **req.to_wire()}
    if carry is not None and not carry.empty:
        obj["carry"] = carry.to_wire()
    return _pack(obj)


def decode_request(payload: bytes) -> tuple[int, Request, Carry | None]:
    """Parse a request payload -> (seq, request, its carry or None); raises FrameError
    (with ``seq`` when it was readable)."""
    obj = _unpack(payload)
    seq = _seq(obj)
    op = obj.pop("op", None)
    del obj["seq"]
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise FrameError(f"unknown op {op!r}; known: {sorted(REQUESTS)}", seq)
    try:
        wire = obj.pop("carry", None)
        carry = None if wire is None else Carry.from_wire(_mapping(wire, "carry"))
        return seq, cls.from_wire(obj), carry
    except FrameError as e:
        e.seq = seq
        raise


def _mapping(v: object, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise FrameError(f"{what} must be a map, got {type(v).__name__}")
    return v


def encode_reply(seq: int, reply: Reply | ErrorReply, carried: tuple[bytes, ...] = ()) -> bytes:
    _seq({"seq": seq})
    if isinstance(reply, ErrorReply):
        return _pack({"seq": seq, "ok": False, "error": reply.error})
    obj = {"seq": seq, "ok": True, **reply.to_wire()}
    if carried:
        obj["carried"] = list(carried)
    return _pack(obj)


def pop_carried(seq: int, obj: dict[str, Any]) -> tuple[bytes, ...]:
    """The bytes a reply carries back (a map from ``unpack_reply``; removed from it)."""
    carried = obj.pop("carried", [])
    if not isinstance(carried, list) or not all(isinstance(b, bytes) for b in carried):
        raise FrameError("a reply's carried must be a list of bytes", seq)
    return tuple(carried)


def unpack_reply(payload: bytes) -> tuple[int, dict[str, Any]]:
    """First half of ``decode_reply``: the seq and the raw map, to route a reply by seq."""
    obj = _unpack(payload)
    seq = _seq(obj)
    del obj["seq"]
    return seq, obj


def encode_progress(seq: int, stage: str) -> bytes:
    """A progress note: request ``seq`` is still being worked on (``stage`` says how far)."""
    _seq({"seq": seq})
    return _pack({"seq": seq, "progress": stage})


def progress_stage(seq: int, obj: dict[str, Any]) -> str | None:
    """The stage of a progress note (a map from ``unpack_reply``), None for a reply."""
    if "progress" not in obj:
        return None
    stage = obj["progress"]
    if set(obj) != {"progress"} or not isinstance(stage, str):
        got = repr(obj)[:80]
        raise FrameError(f"a progress note carries exactly a string 'progress', got {got}", seq)
    return stage


def reply_from_wire(seq: int, obj: dict[str, Any], op: str) -> Reply | ErrorReply:
    """Second half of ``decode_reply``: the typed reply to a request of ``op``."""
    ok = obj.pop("ok", None)
    if ok is False:
        if set(obj) != {"error"} or not isinstance(obj["error"], str):
            got = repr(obj)[:80]
            raise FrameError(f"a failure reply carries exactly a string 'error', got {got}", seq)
        return ErrorReply(obj["error"])
    if ok is not True:
        raise FrameError(f"reply field 'ok' must be true or false, got {ok!r}", seq)
    try:
        return REPLIES[op].from_wire(obj)
    except FrameError as e:
        e.seq = seq
        raise


def decode_reply(payload: bytes, op: str) -> tuple[int, Reply | ErrorReply]:
    """Parse the reply to a request of ``op``."""
    seq, obj = unpack_reply(payload)
    return seq, reply_from_wire(seq, obj, op)
