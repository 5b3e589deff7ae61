"""REST: model records. Credentials are write-only and never returned."""

from __future__ import annotations

from django.core.validators import RegexValidator
from rest_framework import serializers, viewsets

from pooling import services
from pooling.models import RECORD_FIELDS, ModelRecord
from sageproject.api import JSONObjectField, StrictFieldsMixin

# What ``base_url`` takes, stated once for the server and the schema (the field's
# ``pattern``): http or https, a host — DNS labels of 1-63 letters, digits and hyphens, an
# IPv4 address, a bracketed IPv6 address — an optional port (0-65535), then an optional
# path and query of URI characters (RFC 3986: unreserved, sub-delimiters, ":", "@", "/",
# "%XX"). Single-label hosts (``http://ollama:11434``) are fine; Django's URLValidator,
# which insists on a top-level domain and refuses hosts longer than 253 characters, would
# refuse values a schema cannot describe. Empty (allowed besides the pattern, as the
# schema's oneOf says): the protocol's default endpoint.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
_URI_CHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})"
BASE_URL_PATTERN = (
    rf"\Ahttps?://(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]{{2,45}}\])(?::{_PORT})?"
    rf"(?:/{_URI_CHAR}*)?(?:\?(?:{_URI_CHAR}|\?)*)?\Z"
)

URL_VALIDATOR = RegexValidator(
    BASE_URL_PATTERN,
    "Enter an http or https URL: host (DNS labels of at most 63 characters), "
    "optional port, path and query.",
)


class ModelRecordSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    base_url = serializers.CharField(
        max_length=500,
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        validators=[URL_VALIDATOR],
        help_text="The upstream's base URL (http or https); empty for the protocol's default.",
    )
    api_key = serializers.CharField(
        write_only=True,
        required=False,
        allow_blank=True,
        style={"input_type": "password"},
        max_length=4096,
    )
    has_credentials = serializers.BooleanField(read_only=True)
    shared = serializers.SerializerMethodField()
    options = JSONObjectField(required=False)

    class Meta:
        model = ModelRecord
        fields = [
            "id",
            *RECORD_FIELDS,
            "api_key",
            "has_credentials",
            "shared",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "has_credentials", "shared", "created_at", "updated_at"]

    def get_shared(self, obj: ModelRecord) -> bool:
        return obj.owner_id is None

    def create(self, validated_data):
        api_key = validated_data.pop("api_key", "")
        record = ModelRecord(**validated_data)
        record.api_key = api_key
        return services.model_record_save(record=record)

    def update(self, instance, validated_data):
        if "api_key" in validated_data:
            instance.api_key = validated_data.pop("api_key")
        for key, value in validated_data.items():
            setattr(instance, key, value)
        return services.model_record_save(record=instance)


class ModelRecordViewSet(viewsets.ModelViewSet):
    """Model records you own, plus the shared ones (read-only unless you are staff)."""

    serializer_class = ModelRecordSerializer

    def get_queryset(self):
        user = self.request.user
        if self.action in ("list", "retrieve") or user.is_staff:
            return ModelRecord.objects.usable_by(user.pk)
        return ModelRecord.objects.filter(owner=user)

    def perform_create(self, serializer):
        serializer.save(owner=self.request.user)
