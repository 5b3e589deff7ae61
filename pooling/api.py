"""REST: model records. Credentials are write-only and never returned."""

from __future__ import annotations

from django.db.models import Q
from rest_framework import serializers, viewsets

from pooling import services
from pooling.models import ModelRecord
from sageproject.api import JSONObjectField, StrictFieldsMixin


class ModelRecordSerializer(StrictFieldsMixin, serializers.ModelSerializer):
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
            "name",
            "protocol",
            "base_url",
            "model",
            "options",
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
        if self.action in ("list", "retrieve"):
            return ModelRecord.objects.filter(Q(owner=user) | Q(owner__isnull=True))
        if user.is_staff:
            return ModelRecord.objects.filter(Q(owner=user) | Q(owner__isnull=True))
        return ModelRecord.objects.filter(owner=user)

    def perform_create(self, serializer):
        serializer.save(owner=self.request.user)
