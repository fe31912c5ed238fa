"""What every API route shares at the HTTP edge: the error type and JSON field readers.

`APIError` carries a status, a message and the offending field (`param`); each API shapes
it its own way (OpenAI's {"error": {...}} by `APIError.body`, Anthropic's
{"type": "error", ...} by `luced.api.anthropic.error_body`). The readers take a JSON
object and a field name and return the value checked, or raise a 400 naming the field.
A `Spelling` names nested fields and words a wrong type as its API does (`OPENAI`, also
Ollama's and the Responses API's, or `ANTHROPIC`).
"""

from __future__ import annotations

import json
import json.scanner
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


# --- errors ------------------------------------------------------------------------------


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# --- JSON in ----------------------------------------------------------------------------


def decode_body(raw: bytes, yielding: bool = False) -> dict[str, Any]:
    """The request body as a JSON object, or a 400.

    `yielding`: with the json module's pure-Python scanner (its own fallback, the same
    results), which lets other threads run between values; the C decoder holds the GIL
    throughout, a second or more for millions of small values. Ten times slower: for
    bodies of many values, decoded in a thread."""
    try:
        if yielding:
            decoder = json.JSONDecoder()
            decoder.scan_once = json.scanner.py_make_scanner(decoder)
            body = decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
        else:
            body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {json_kind(body)}")
    return body


# --- numeric ranges ---------------------------------------------------------------------

# Every numeric request field has an inclusive range at the API, so that a value the worker
# cannot use (top_k 1e30, temperature 1e-300) is a 400 naming the field, never a 500. Each
# range lies inside what `SamplingParams` accepts, and the sampler is property-tested safe
# over all of SamplingParams' range (tests/runtime/test_sampler.py), so these bounds are
# about sense, not safety. Anthropic's routes narrow temperature and top_p to [0, 1].
INT32_MAX = 2**31 - 1
# No token is this long; a prompt longer than this per context token cannot fit anyway.
MAX_CHARS_PER_TOKEN = 32
MAX_TOP_LOGPROBS = 20  # the worker returns at most 20 alternatives per token
NUMBER_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),  # OpenAI documents [0, 2]; vLLM takes any value >= 0
    "top_p": (0.0, 1.0),  # SamplingParams refuses 0 itself: (0, 1]
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),  # 1 = off; llama.cpp's useful range is ~[0.5, 2]
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}
INT_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (-1, INT32_MAX),  # -1 and 0 = off
    "seed": (-(2**63), 2**64 - 1),  # what torch.Generator.manual_seed takes
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "n": (1, 128),  # OpenAI's bound
    "best_of": (1, INT32_MAX),
    "logprobs": (0, MAX_TOP_LOGPROBS),
    "top_logprobs": (0, MAX_TOP_LOGPROBS),
}


# --- field readers -----------------------------------------------------------------------


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def read_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean, got {json_kind(value)}")
    return value


def as_int(param: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(param, f"{param} must be an integer, got {json_kind(value)}")
    return value


def read_int(
    body: Mapping[str, Any], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    n = as_int(name, value)
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        shown = str(n) if abs(n) < 10**30 else f"an integer of {len(str(abs(n)))} digits"
        raise bad(name, f"{name} must be {bounds}, got {shown}")
    return n


def read_number(
    body: Mapping[str, Any], name: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"{name} must be a number, got {json_kind(value)}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        x = math.inf
    if not math.isfinite(x):
        raise bad(name, f"{name} must be a finite number")
    if lo is not None and hi is not None and not lo <= x <= hi:
        raise bad(name, f"{name} must be in [{lo:g}, {hi:g}], got {x:g}")
    return x


def read_text(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad(param, f"{param} must be a string, got {json_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON allows "\ud800"; no tokenizer does
        raise bad(param, f"{param} contains a lone UTF-16 surrogate") from None
    return value


# --- nested fields ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spelling:
    """How an API names the field of an array item and words a wrong type:

    OPENAI     messages[2].content   "messages[2] must be an object, got string"
    ANTHROPIC  messages.2.content    "messages.2: expected an object, got string"
    """

    dotted: bool

    def item(self, param: str, i: int) -> str:
        return f"{param}.{i}" if self.dotted else f"{param}[{i}]"

    def expected(self, param: str, what: str, got: str) -> APIError:
        """A 400 on `param`: it must be `what` but is `got` (a JSON kind, or words)."""
        verb = ": expected" if self.dotted else " must be"
        return bad(param, f"{param}{verb} {what}, got {got}")

    def object(self, param: str, value: Any) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.expected(param, "an object", json_kind(value))
        return value


OPENAI = Spelling(dotted=False)
ANTHROPIC = Spelling(dotted=True)
