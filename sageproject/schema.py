"""The OpenAPI schema (``GET /api/schema/``) as the server behaves: drf-spectacular's
AutoSchema with the API's error responses and input rules added.

Kept apart from `sageproject.api`: drf-spectacular's schema module imports DRF's generic
views, which import the pagination class that module defines.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular import openapi
from rest_framework import serializers

from sageproject.api import ErrorEnvelopeSerializer, StrictFieldsMixin
from sageproject.parsers import MAX_JSON_DEPTH

# Strings as the JSON parser and the fields take them: never a NUL (`sageproject.parsers`)
# and, where blanks are refused after trimming, some character that is not whitespace.
# (Python reads these patterns the same way: "\uXXXX" escapes, no "\s".)
NO_NUL = r"^[^\u0000]*$"
NO_NUL_NOT_EMPTY = r"^[^\u0000]+$"
# Whitespace as the fields trim it (Python's str.strip(), which DRF uses), spelled out:
# ECMA's "\s" (the schema's regex dialect) leaves out \u001c-\u001f and \u0085 and takes
# \ufeff, so "\r \u001e" would look not blank to a client and be blank to the server.
WHITESPACE = (
    r"\u0009-\u000d\u001c-\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
)
NOT_BLANK = rf"^[{WHITESPACE}]*[^{WHITESPACE}\u0000][^\u0000]*$"

_ERRORS = {
    "400": "Invalid request: a body that is not JSON, or JSON holding a NUL character "
    "(\\u0000, in any string or key, free-form objects included), a lone surrogate or nesting "
    f"deeper than {MAX_JSON_DEPTH} levels (request.malformed); or a field or query parameter "
    "that breaks its rule (request.invalid, details.fields names it).",
    "401": "No valid credentials (auth.required).",
    "403": "Not allowed (auth.forbidden, or a permission of the object's kind).",
    "404": "No such object, or another user's (not_found, <kind>.not_found); a page past "
    "the last one.",
    "409": "Conflicts with the current state.",
    "413": "The body is larger than SAGE_MAX_REQUEST_BYTES (request.too_large).",
    "415": "The body is not application/json (request.unsupported_media_type).",
}


class AutoSchema(openapi.AutoSchema):
    """The schema says what the server does: every error response an operation can give
    (the `ErrorEnvelopeSerializer` component), ``additionalProperties: false`` on request
    bodies that refuse unknown fields (`StrictFieldsMixin`), and a pattern on request
    strings: no NUL, and not blank once trimmed where blanks are refused."""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        writes = self.method in ("POST", "PUT", "PATCH")
        body = writes and self.get_request_serializer() is not None
        queried = any(p.get("in") == "query" for p in self._get_parameters())
        codes = ["401", "403", "404"]
        if body or queried:
            codes.append("400")
        if writes:
            codes.append("409")
        if body:
            codes += ["413", "415"]
        for code in sorted(codes):
            if code not in responses:
                response = self._get_response_for_code(
                    ErrorEnvelopeSerializer, code, direction=direction
                )
                responses[code] = {**response, "description": _ERRORS[code]}
        return dict(sorted(responses.items()))

    def _map_basic_serializer(self, serializer: Any, direction: Any) -> dict[str, Any]:
        schema = super()._map_basic_serializer(serializer, direction)
        if type(serializer).__doc__ is None:
            schema.pop("description", None)  # a mixin's docstring, not this body's
        if direction == "request" and isinstance(serializer, StrictFieldsMixin):
            schema["additionalProperties"] = False
        return schema

    def _map_serializer_field(
        self, field: Any, direction: Any, bypass_extensions: bool = False
    ) -> dict[str, Any]:
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if (
            direction == "request"
            and isinstance(field, serializers.CharField)
            and schema.get("type") == "string"
            and "pattern" not in schema
            # A field's own RegexValidator is its pattern (drf-spectacular adds it next).
            and not any(isinstance(v, RegexValidator) for v in field.validators)
        ):
            # Anchored: schemathesis folds an unanchored "\S" and the lengths into
            # "^\S{1,n}$", which would make "a b" look invalid. Where blanks are allowed,
            # drf-spectacular offers "" as a oneOf branch of its own (maxLength 0), so the
            # pattern must not match it too: oneOf takes exactly one.
            if field.allow_blank:
                schema["pattern"] = NO_NUL_NOT_EMPTY
            elif field.trim_whitespace:
                schema["pattern"] = NOT_BLANK
            else:
                schema["pattern"] = NO_NUL
        return schema
