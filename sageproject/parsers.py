"""The one input-validation layer of the API: JSON request bodies and query parameters.

Every JSON body goes through `JSONParser`, which refuses what some database cannot store
or some code cannot walk — a NUL character, a lone surrogate, invalid UTF-8, a number too
large for a double, nesting deeper than `MAX_JSON_DEPTH` — with 400 ``request.malformed``
on every database alike (SQLite would store a NUL that PostgreSQL refuses; the API must not
answer differently). Query parameters are read with `query_int`, `query_uuid`,
`query_choice` and `query_bool`: a value that is not what the parameter takes is 400
``request.invalid`` naming the parameter in ``details.fields``, never a 500 from the query
it would have reached.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Iterable
from typing import IO, Any

import orjson
from rest_framework import parsers, serializers
from rest_framework.exceptions import ParseError
from rest_framework.request import Request

# Deeper documents are refused. A value stored from a body (options, a manifest) then nests
# at most 31 levels, which every database stores: MariaDB's JSON refuses 32. Manifests and
# options nest a dozen levels at most, and every recursive walk of them stays far from
# Python's recursion limit.
MAX_JSON_DEPTH = 32

# The largest integer a query parameter takes unless it says otherwise: a 64-bit column.
MAX_QUERY_INT = 2**63 - 1


class JSONParser(parsers.JSONParser):
    """JSON bodies, parsed with orjson (strict UTF-8, no lone surrogates, no NaN or
    infinities), then refused when a string or key holds a NUL or the document nests
    deeper than `MAX_JSON_DEPTH`. Every refusal is a ``ParseError`` (400
    ``request.malformed``).

    A subclass of DRF's so that DRF hands it ``request.body``, which is bounded by
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (413), rather than the raw stream."""

    def parse(
        self,
        stream: IO[bytes] | None,
        media_type: str | None = None,
        parser_context: dict[str, Any] | None = None,
    ) -> Any:
        raw = stream.read() if stream is not None else b""
        # DRF's choice of charset: the request's, text encodings only (never bz2_codec).
        return parse_json(raw, encoding=parsers.get_encoding(parser_context or {}))


def parse_json(raw: bytes, *, encoding: str = "utf-8") -> Any:
    """The document in ``raw`` (decoded from ``encoding`` when that is not UTF-8).

    Raises ``ParseError`` for anything `JSONParser` refuses."""
    text: bytes | str = raw
    try:
        if codecs.lookup(encoding).name != "utf-8":
            text = raw.decode(encoding)
    except (LookupError, UnicodeDecodeError) as exc:
        raise ParseError(f"JSON parse error - not {encoding} text: {exc}") from None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise ParseError(_too_deep()) from None
        raise ParseError(f"JSON parse error - {exc}") from None
    # The walk is skipped, on cheap counts, for the usual body: no NUL escape in it, and
    # fewer brackets than the depth limit.
    if isinstance(text, str):
        text = text.encode()
    if b"\\u0000" in text or text.count(b"[") + text.count(b"{") > MAX_JSON_DEPTH:
        _check_tree(data)
    return data


def _too_deep() -> str:
    return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"


def _check_tree(data: Any) -> None:
    """Refuse a NUL in any string or key, and nesting beyond `MAX_JSON_DEPTH` (iterative:
    the walk itself never recurses)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise ParseError(f"NUL character (\\u0000) in the string at {path or '(body)'}")
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ParseError(_too_deep())
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and "\x00" in key:
                    raise ParseError(f"NUL character (\\u0000) in a key at {path or '(body)'}")
                stack.append((item, depth + 1, where))


# --- query parameters ------------------------------------------------------------------


def _invalid(name: str, rule: str) -> serializers.ValidationError:
    return serializers.ValidationError({name: [rule]})


def _raw(request: Request, name: str) -> str | None:
    # Present means given: an empty value is not a value of any kind a parameter takes
    # (the schema says so too), so it is refused rather than read as absent.
    return request.query_params.get(name)


def query_int(
    request: Request,
    name: str,
    default: int,
    *,
    minimum: int,
    maximum: int = MAX_QUERY_INT,
) -> int:
    """The integer query parameter ``name`` (``default`` when absent); anything but
    ASCII digits in ``minimum..maximum`` is 400 ``request.invalid`` naming it."""
    raw = _raw(request, name)
    if raw is None:
        return default
    digits = raw[1:] if raw[:1] == "-" else raw
    value = int(raw) if digits.isascii() and digits.isdigit() and len(digits) <= 19 else None
    if value is None or not minimum <= value <= maximum:
        if maximum == MAX_QUERY_INT:
            raise _invalid(name, f"must be an integer ≥ {minimum}")
        raise _invalid(name, f"must be an integer from {minimum} to {maximum}")
    return value


def query_uuid(request: Request, name: str) -> uuid.UUID | None:
    """The UUID query parameter ``name``, None when absent; anything else is 400
    ``request.invalid`` naming it."""
    raw = _raw(request, name)
    if raw is None:
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise _invalid(name, "must be a UUID") from None


def query_choice(request: Request, name: str, choices: Iterable[str]) -> str | None:
    """The query parameter ``name`` when it is one of ``choices``, None when absent; any
    other value is 400 ``request.invalid`` naming it and the choices."""
    raw = _raw(request, name)
    allowed = list(choices)
    if raw is None:
        return None
    if raw not in allowed:
        raise _invalid(name, f"must be one of: {', '.join(allowed)}")
    return raw


def int_schema(minimum: int, maximum: int = MAX_QUERY_INT) -> dict[str, Any]:
    """The OpenAPI schema of an integer query parameter read by `query_int` with these
    bounds (so the schema states the rule the server enforces)."""
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
# Every value a boolean query parameter takes, exactly (its schema's enum).
BOOL_VALUES = _TRUE + _FALSE


def query_bool(request: Request, name: str) -> bool | None:
    """The boolean query parameter ``name`` (true/false, 1/0, yes/no, on/off: `BOOL_VALUES`,
    lower case as its schema's enum lists them), None when absent; anything else is 400
    ``request.invalid`` naming it."""
    raw = _raw(request, name)
    if raw is None:
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise _invalid(name, f"must be one of: {', '.join(BOOL_VALUES)}")
