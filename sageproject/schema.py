"""The OpenAPI schema (``GET /api/schema/``) as the server behaves: drf-spectacular's
AutoSchema with the API's error responses and input rules added.

Kept apart from `sageproject.api`: drf-spectacular's schema module imports DRF's generic
views, which import the pagination class that module defines.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular import openapi
from rest_framework import serializers

from sageproject.api import ErrorEnvelopeSerializer, StrictFieldsMixin
from sageproject.parsers import MAX_JSON_DEPTH

# Strings as the JSON parser and the fields take them: never a NUL (`sageproject.parsers`)
# and, where blanks are refused after trimming, some character that is not whitespace.
NO_NUL = r"^[^\u0000]*$"
NOT_BLANK = r"^\s*[^\s\u0000][^\u0000]*$"

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
        ):
            # Anchored: schemathesis folds an unanchored "\S" and the lengths into
            # "^\S{1,n}$", which would make "a b" look invalid.
            blank_refused = not field.allow_blank and field.trim_whitespace
            schema["pattern"] = NOT_BLANK if blank_refused else NO_NUL
        return schema
