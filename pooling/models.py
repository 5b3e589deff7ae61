from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Coalesce

from pooling import crypto


class Protocol(models.TextChoices):
    # Any OpenAI-compatible Chat Completions server (OpenAI, vLLM, Ollama, LM Studio).
    OPENAI = "openai", "OpenAI-compatible"
    # Anthropic's Messages API.
    ANTHROPIC = "anthropic", "Anthropic"
    # The built-in keyless deterministic model, for demos, tests and benchmarks.
    SCRIPTED = "scripted", "Scripted (built-in)"


class ModelRecordQuerySet(models.QuerySet):
    def usable_by(self, owner_id: int | None) -> ModelRecordQuerySet:
        """The records an owner's agents may use: their own and the shared ones
        (``owner_id=None``: the shared ones only); never another user's."""
        shared = models.Q(owner__isnull=True)
        return self.filter(shared if owner_id is None else shared | models.Q(owner_id=owner_id))

    def for_run(self, owner_id: int, name: str) -> ModelRecord | None:
        """The record a run of ``owner_id`` uses for ``name``: the owner's own before the
        shared one of that name (NULL sorts first on SQLite and MySQL, last on
        PostgreSQL: say where)."""
        return (
            self.usable_by(owner_id)
            .filter(name=name)
            .order_by(models.F("owner_id").asc(nulls_last=True))
            .first()
        )


# The fields that say which model a record reaches and how, in the order the admin and the
# API show them; its owner and its (write-only) credentials are handled apart.
RECORD_FIELDS = ("name", "protocol", "base_url", "model", "options")


class ModelRecord(models.Model):
    """A model a package's agents may name; owner null = shared with every user."""

    objects = ModelRecordQuerySet.as_manager()

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="model_records",
    )
    name = models.CharField(max_length=100)
    # The owner's id, or 0 for a shared record, computed and stored by the database: never
    # null, so one plain unique constraint on (owner_key, name) makes a user's names unique
    # and shared names unique on every database. A constraint on ``name`` with the condition
    # ``owner IS NULL`` needs partial indexes, which MySQL and MariaDB lack (Django would
    # skip it there, warning W036), and NULL owners never collide in (owner, name).
    owner_key = models.GeneratedField(
        expression=Coalesce("owner", 0),
        output_field=models.BigIntegerField(),
        db_persist=True,
    )
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
            models.UniqueConstraint(
                fields=["owner_key", "name"],
                name="model_record_owner_key_name",
                violation_error_message=(
                    "A model record with this name already exists (for this owner, or shared)."
                ),
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
