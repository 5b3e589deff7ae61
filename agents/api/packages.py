"""REST: agent packages (``/api/v1/packages/``) — save, validate, activate, fork, list."""

from __future__ import annotations

from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from agents.manifest import MAX_VERSION_CHARS, NAME_PATTERN, VERSION_PATTERN
from agents.models import AgentPackage
from agents.services import packages
from sageproject.api import ErrorEnvelopeSerializer, JSONObjectField, StrictFieldsMixin
from sageproject.errors import NotFoundError
from sageproject.parsers import (
    BOOL_VALUES,
    query_bool,
)


def _ecma(pattern: str) -> str:
    """A Python pattern anchored with ``\\A``/``\\Z`` as the schema writes it (ECMA anchors)."""
    return "^" + pattern.removeprefix(r"\A").removesuffix(r"\Z") + "$"


# The manifest's outline as the schema shows it: what `agents.manifest.parse_manifest`
# requires of the top level (the keys, their JSON types, the name and version rules). What
# no schema can say — the entrypoint naming one of the agents or flows, the agents' and
# flows' own rules, the bundled paths — is refused with 400 ``package.invalid`` listing
# every problem.
MANIFEST_SCHEMA = {
    "type": "object",
    "description": "The package manifest (DESIGN §4).",
    "required": ["name", "version", "entrypoint", "agents"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": _ecma(NAME_PATTERN), "maxLength": 100},
        "version": {
            "type": "string",
            "pattern": _ecma(VERSION_PATTERN),
            "maxLength": MAX_VERSION_CHARS,
        },
        "entrypoint": {
            "type": "string",
            "minLength": 1,
            "description": "An agent id or a flow id of this manifest.",
        },
        "agents": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {"type": "object"},
            "description": "Agent id → agent (model, instructions, tools, skills, ...).",
        },
        "flows": {
            "type": "object",
            "nullable": True,
            "additionalProperties": {"type": "object"},
        },
        "files": {
            "type": "object",
            "nullable": True,
            "additionalProperties": {"type": "string"},
            "description": "Relative path → text.",
        },
    },
}


@extend_schema_field(MANIFEST_SCHEMA)
class ManifestField(JSONObjectField):
    """A package manifest: a JSON object, checked in full by ``parse_manifest``."""


class PackageCreateSerializer(StrictFieldsMixin, serializers.Serializer):
    manifest = ManifestField(help_text="The package manifest (DESIGN §4).")
    activate = serializers.BooleanField(default=True)


class PackageValidateSerializer(StrictFieldsMixin, serializers.Serializer):
    strict = serializers.BooleanField(
        required=False, help_text="Refuse (package.not_ready) when anything is missing."
    )


class PackageActivateSerializer(StrictFieldsMixin, serializers.Serializer):
    expected_ref = serializers.CharField(
        max_length=64,
        allow_null=True,
        required=True,
        help_text="The ref you believe is active now (null when none is).",
    )


class PackageForkSerializer(StrictFieldsMixin, serializers.Serializer):
    version = serializers.CharField(
        max_length=MAX_VERSION_CHARS,
        trim_whitespace=False,
        validators=[RegexValidator(VERSION_PATTERN, "must be MAJOR.MINOR.PATCH, e.g. '1.0.0'")],
        help_text="The new version: MAJOR.MINOR.PATCH, e.g. '1.0.1'.",
    )


class PackageSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.get_username", read_only=True)

    class Meta:
        model = AgentPackage
        fields = [
            "id",
            "name",
            "version",
            "ref",
            "active",
            "owner",
            "visibility",
            "manifest",
            "files",
            "created_at",
        ]
        read_only_fields = ["visibility"]


def _body(result: dict[str, Any]) -> dict[str, Any]:
    """A save result as JSON: the validation report plus the stored package."""
    package = result["package"]
    return {
        **PackageSerializer(package).data,
        **{k: v for k, v in result.items() if k not in ("package", "agents", "name", "version")},
        "agent_ids": result["agents"],
    }


class PackageViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Agent packages you own. A version is immutable; saving it again is a no-op
    (``reused: true``; in strict mode after a full revalidation)."""

    serializer_class = PackageSerializer

    def get_queryset(self):
        """What the caller may use: their own versions and those shared with them (staff:
        every version)."""
        user = self.request.user
        query = AgentPackage.objects.select_related("owner")
        return query if user.is_staff else query.usable_by(user.pk)

    @extend_schema(
        request=PackageCreateSerializer,
        responses={
            200: OpenApiResponse(PackageSerializer, description="This version exists already."),
            201: PackageSerializer,
            400: OpenApiResponse(
                ErrorEnvelopeSerializer,
                description="A field that breaks its rule (request.invalid), a manifest that "
                "does not validate (package.invalid: details.errors lists every problem, e.g. "
                "an entrypoint naming no agent or flow) or, in strict mode, one whose tools, "
                "skills or model records are missing (package.not_ready).",
            ),
        },
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = PackageCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = packages.package_save(
            owner=request.user,
            manifest=data.validated_data["manifest"],
            activate=data.validated_data["activate"],
        )
        code = status.HTTP_200_OK if result["reused"] else status.HTTP_201_CREATED
        return Response(_body(result), status=code)

    @extend_schema(
        request=PackageValidateSerializer,
        parameters=[
            OpenApiParameter(
                "strict",
                {"type": "string", "enum": list(BOOL_VALUES)},
                description="Same as the body flag (which wins when both are given).",
            )
        ],
        responses={
            200: dict,
            400: OpenApiResponse(
                ErrorEnvelopeSerializer,
                description="A field or query parameter that breaks its rule "
                "(request.invalid) or, strict, a version whose tools, skills or model records "
                "are missing (package.not_ready, listing them).",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def validate(self, request: Request, pk: str | None = None) -> Response:
        """Re-check the saved version's tools, skills and model records now; the report is
        stored. Strict (``?strict=1`` or ``{"strict": true}``) answers 400
        ``package.not_ready`` listing what is missing."""
        package = self._own(pk)
        data = PackageValidateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        query = query_bool(request, "strict")  # read (and refused when invalid) either way
        strict = data.validated_data.get("strict")
        if strict is None:
            strict = query
        report = packages.package_validate(
            owner=request.user, package=package, readiness=True, strict=bool(strict)
        )
        return Response(report)

    @extend_schema(request=PackageActivateSerializer, responses={200: dict})
    @action(detail=True, methods=["post"])
    def activate(self, request: Request, pk: str | None = None) -> Response:
        """Make this version the active one; ``expected_ref`` must name the current one
        (409 ``package.active_conflict`` otherwise)."""
        package = self._own(pk)
        data = PackageActivateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = packages.package_activate(
            owner=request.user, package=package, expected_ref=data.validated_data["expected_ref"]
        )
        return Response(result)

    @extend_schema(
        request=PackageForkSerializer,
        responses={
            200: OpenApiResponse(PackageSerializer, description="This version exists already."),
            201: PackageSerializer,
        },
    )
    @action(detail=True, methods=["post"])
    def fork(self, request: Request, pk: str | None = None) -> Response:
        """Copy this version under a new version number (a new immutable ref)."""
        package = self._own(pk)
        data = PackageForkSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = packages.package_fork(
            owner=request.user, package=package, version=data.validated_data["version"]
        )
        code = status.HTTP_200_OK if result["reused"] else status.HTTP_201_CREATED
        return Response(_body(result), status=code)

    def _own(self, pk: str | None) -> AgentPackage:
        # Owner-scoped even for staff: validating, activating and forking act as the owner.
        # An id that is not a row id (not digits, beyond a 64-bit key) names no package.
        if not (pk and pk.isascii() and pk.isdigit() and len(pk) <= 19 and int(pk) < 2**63):
            raise NotFoundError("package.not_found", "agent package not found in caller scope")
        package = AgentPackage.objects.filter(pk=int(pk), owner=self.request.user).first()
        if package is None:
            raise NotFoundError("package.not_found", "agent package not found in caller scope")
        return package
