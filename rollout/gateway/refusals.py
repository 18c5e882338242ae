"""How the gateway refuses a request: `ProtocolError` (rendered in the caller's protocol's
error shape) with an `ErrorReason` (counted as `gateway/errors/<reason>`), and the cheap
checks every request body passes before any field is read: its size, UTF-8, JSON nesting
depth, NaN/Infinity and lone surrogates (rollout.gateway.server reads the body,
rollout.gateway.protocol validates the fields).

The checks cost one pass over the bytes (C and numpy speed) and never recurse, so a
hostile body (100k-deep nesting, a 50 MB string, `"\\ud800"`) is refused with a 4xx
before the JSON decoder, the chat template or the tokenizer sees it.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

Protocol = Literal["openai", "anthropic"]

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # GatewaySettings.max_body_bytes
DEFAULT_MAX_JSON_DEPTH = 64  # GatewaySettings.max_json_depth: tool schemas nest ~10 deep


class ErrorReason(str, enum.Enum):
    """Why a request got an error status; `gateway/errors/<value>` counts each."""

    AUTH = "auth"  # 401/403: no token, an unknown one, or another session's
    NO_SESSION = "no_session"  # 404: the session is not open (never was, or closed)
    TOO_LARGE = "too_large"  # 413: the body is over GatewaySettings.max_body_bytes
    MALFORMED = "malformed"  # 400: not JSON, not UTF-8, too deep, NaN/Infinity, a lone surrogate
    INVALID = "invalid"  # 400: a field of the wrong type or value, or one the template cannot render
    UNSUPPORTED = "unsupported"  # 400: a feature the gateway refuses to approximate (docs/gateway.md)
    CONTEXT = "context"  # 400: the conversation cannot fit the session's token budget
    SERVER = "server"  # 500: generation failed (the engine), or a gateway bug


_DEFAULT_REASON = {401: ErrorReason.AUTH, 403: ErrorReason.AUTH, 404: ErrorReason.NO_SESSION,
                   413: ErrorReason.TOO_LARGE, 500: ErrorReason.SERVER}
# The protocol's name for each HTTP status the gateway returns.
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    500: "api_error"}
_OPENAI_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_denied",
                 404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
                 500: "server_error"}


class ProtocolError(Exception):
    """A request the gateway refuses; rendered in the caller's protocol's error shape.
    `param` names the offending field (OpenAI's `error.param`); `reason` is what
    gateway/errors counts it under (by default from the status; 400 is `invalid`)."""

    def __init__(self, status: int, message: str, code: str | None = None, *, param: str | None = None,
                 reason: ErrorReason | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.reason = reason or _DEFAULT_REASON.get(status, ErrorReason.INVALID)

    def body(self, protocol: Protocol) -> dict[str, Any]:
        if protocol == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_KINDS.get(self.status, "api_error"),
                                                "message": self.message}}
        return {"error": {"message": self.message, "type": _OPENAI_KINDS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def malformed(message: str) -> ProtocolError:
    return ProtocolError(400, message, reason=ErrorReason.MALFORMED)


def _named(param: str, message: str) -> str:
    """The message names the field (Anthropic's error shape has no `param`)."""
    return message if not param or param in message else f"{param}: {message}"


def invalid(param: str, message: str) -> ProtocolError:
    """A field with a value the protocol does not allow (400, named)."""
    return ProtocolError(400, _named(param, message), param=param or None, reason=ErrorReason.INVALID)


def unsupported(param: str, message: str) -> ProtocolError:
    """A valid request using a feature the gateway refuses rather than approximates."""
    return ProtocolError(400, _named(param, message), param=param, reason=ErrorReason.UNSUPPORTED)


def require(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise invalid(param, message)


# What a JSON field may hold, by the name the error message gives it. bool is an int in
# Python, never in JSON; numbers are finite (1e999 decodes to inf).
_EXPECTED: dict[str, Callable[[Any], bool]] = {
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float)
                                                                               and math.isfinite(v)),
    "an object": lambda v: isinstance(v, Mapping),
    "an array": lambda v: isinstance(v, list),
}


def json_kind(value: Any) -> str:
    """What a decoded JSON value is, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite number"
    return next(name for name, fits in _EXPECTED.items() if fits(value))


def wrong_type(param: str, expected: str, value: Any) -> ProtocolError:
    return invalid(param, f"'{param}' must be {expected}, got {json_kind(value)}")


def checked_field(obj: Mapping[str, Any], key: str, param: str, expected: str, *, required: bool = False) -> Any:
    """`obj[key]` checked against `expected` (a key of _EXPECTED); None where it is absent
    or null and not `required`."""
    value = obj.get(key)
    if value is None:
        if required:
            raise invalid(param, f"'{param}' is required ({expected})")
        return None
    if not _EXPECTED[expected](value):
        raise wrong_type(param, expected, value)
    return value


def check_fields(obj: Mapping[str, Any], expected: Mapping[str, str], prefix: str = "") -> None:
    """Type-check optional fields that have no effect (accepted so harnesses work as
    against the real API), so a wrong type is still a 400."""
    for key, kind in expected.items():
        checked_field(obj, key, prefix + key, kind)


def too_large(limit: int, size: int | None) -> ProtocolError:
    """413 for a body over `limit` bytes (`size` where its Content-Length told)."""
    told = f"is {size} bytes" if size is not None else f"is over {limit} bytes"
    return ProtocolError(413, f"the request body {told}; this gateway takes at most {limit} bytes "
                              "(GatewaySettings.max_body_bytes)", "request_too_large")


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, without parsing it: escape
    pairs are blanked (backslash runs pair up from the left, as in a JSON string), so the
    quotes left open and close strings; brackets inside strings do not count. One pass of
    C and numpy; for invalid JSON the number is meaningless (the decoder refuses it)."""
    if not data:
        return 0
    plain = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    raw = np.frombuffer(plain, np.uint8)
    in_string = (np.cumsum(raw == ord('"'), dtype=np.int32) & 1).astype(bool)
    step = (raw == ord("[")).astype(np.int8) + (raw == ord("{")) - (raw == ord("]")) - (raw == ord("}"))
    step[in_string] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


# A \uD800-\uDFFF escape: the only way a lone surrogate gets into decoded JSON text (raw
# surrogate bytes are invalid UTF-8). Escaped backslashes make false hits: those only
# cost the exact walk below.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_path(value: Any) -> str | None:
    """Where the first string holding a lone surrogate is, if any (an iterative walk)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path or "the top-level string"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack += [(key, f"{path}.{key!r} (key)"), (child, f"{path}.{key}" if path else key)]
        elif isinstance(item, list):
            stack += [(child, f"{path}[{i}]") for i, child in enumerate(item)]
    return None


def load_json(data: bytes, max_depth: int, what: str = "the request body") -> Any:
    """`data` (UTF-8 JSON text) decoded, or ProtocolError(400, malformed): invalid UTF-8,
    nesting deeper than `max_depth` (checked before decoding, so no recursion), invalid
    JSON (NaN and Infinity too), or a lone surrogate in any string (the tokenizer cannot
    encode one; a pair is one character and fine)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise malformed(f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    if (depth := json_depth(data)) > max_depth:
        raise malformed(f"{what} nests arrays and objects {depth} deep; at most {max_depth} are accepted "
                        "(GatewaySettings.max_json_depth)")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN, an int over 4300 digits
        raise malformed(f"{what} is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(data) and (path := _lone_surrogate_path(value)) is not None:
        raise malformed(f"{what}: {path} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                        "which is not a character; send valid Unicode")
    return value
