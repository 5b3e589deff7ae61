from __future__ import annotations

from django.conf import settings
from django.db import models

from pooling import crypto


class Protocol(models.TextChoices):
    # Any OpenAI-compatible Chat Completions server (OpenAI, vLLM, Ollama, LM Studio).
    OPENAI = "openai", "OpenAI-compatible"
    # Anthropic's Messages API.
    ANTHROPIC = "anthropic", "Anthropic"
    # The built-in keyless deterministic model, for demos, tests and benchmarks.
    SCRIPTED = "scripted", "Scripted (built-in)"


class ModelRecord(models.Model):
    """A model a package's agents may name; owner null = shared with every user."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="model_records",
    )
    name = models.CharField(max_length=100)
    protocol = models.CharField(max_length=20, choices=Protocol.choices)
    base_url = models.URLField(max_length=500, blank=True)
    model = models.CharField(max_length=200, blank=True)
    # Fernet token; read and write through ``api_key``. Never returned, logged or shown.
    encrypted_credentials = models.TextField(blank=True, default="")
    options = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="model_record_owner_name"),
            models.UniqueConstraint(
                fields=["name"],
                condition=models.Q(owner__isnull=True),
                name="model_record_shared_name",
            ),
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.protocol})"

    @property
    def api_key(self) -> str:
        return crypto.decrypt(self.encrypted_credentials)

    @api_key.setter
    def api_key(self, value: str) -> None:
        self.encrypted_credentials = crypto.encrypt(value or "")

    @property
    def has_credentials(self) -> bool:
        return bool(self.encrypted_credentials)
