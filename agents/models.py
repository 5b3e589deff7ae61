from __future__ import annotations

import json
import uuid
from typing import Any

from django.conf import settings
from django.db import models

from pooling import crypto
from scheduling.models import OwnedQuerySet


class Visibility(models.TextChoices):
    """Who may open sessions on a package version (staff publish; sessions, runs and
    archives stay private to the user who made them whatever the package's visibility)."""

    PRIVATE = "private", "private (its owner)"
    EVERYONE = "everyone", "shared with every user"
    GROUPS = "groups", "shared with named groups"


class PackageQuerySet(OwnedQuerySet):
    def usable_by(self, user_id: int) -> PackageQuerySet:
        """The versions a user may open sessions on and run: their own, those shared with
        every user, and those shared with a group the user is in."""
        return self.filter(
            models.Q(owner_id=user_id)
            | models.Q(visibility=Visibility.EVERYONE)
            | models.Q(
                pk__in=AgentPackage.shared_with.through.objects.filter(group__user=user_id).values(
                    "agentpackage_id"
                ),
                visibility=Visibility.GROUPS,
            )
        )


class AgentPackage(models.Model):
    """An immutable package version; ``ref`` is the content hash of its manifest and files."""

    objects = PackageQuerySet.as_manager()

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_packages"
    )
    name = models.CharField(max_length=100)
    version = models.CharField(max_length=50)
    ref = models.CharField(max_length=64, db_index=True)
    manifest = models.JSONField()
    files = models.JSONField(default=dict, blank=True)
    active = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    visibility = models.CharField(
        max_length=10, choices=Visibility.choices, default=Visibility.PRIVATE
    )
    shared_with = models.ManyToManyField(
        "auth.Group",
        blank=True,
        related_name="shared_packages",
        help_text="The groups a version with visibility 'groups' is shared with.",
    )

    class Meta:
        ordering = ["name", "-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "name", "version"], name="package_owner_name_version"
            ),
        ]
        indexes = [models.Index(fields=["owner", "name", "active"], name="package_active")]

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


class ReadinessReport(models.Model):
    package = models.ForeignKey(AgentPackage, on_delete=models.CASCADE, related_name="reports")
    checked_at = models.DateTimeField(auto_now_add=True)
    valid = models.BooleanField()
    ready = models.BooleanField()
    strict = models.BooleanField(default=False)
    # {agent_id: {"missing_tools": [...], "missing_skills": [...], "unverified": [...]}}
    agents = models.JSONField(default=dict)
    error = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-checked_at"]

    def __str__(self) -> str:
        return f"{self.package} readiness at {self.checked_at:%Y-%m-%d %H:%M}"


class ManagedAgentRecord(models.Model):
    """The terminal archive of a run: readable with no worker, model client or Application."""

    objects = OwnedQuerySet.as_manager()

    run = models.OneToOneField("scheduling.Run", on_delete=models.CASCADE, related_name="archive")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="archives",
        db_index=False,  # archive_owner_recent leads with it: one index less to write
    )
    package_ref = models.CharField(max_length=64)
    package_name = models.CharField(max_length=100, blank=True)
    agent_id = models.CharField(max_length=100)
    status = models.CharField(max_length=12)
    result = models.JSONField(null=True, blank=True)
    flow_outputs = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    archived_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-archived_at"]
        indexes = [models.Index(fields=["owner", "-archived_at"], name="archive_owner_recent")]

    def __str__(self) -> str:
        return f"archive of {self.run_id}"


class ReclamationStatus(models.TextChoices):
    # Written by an operator; waiting for the worker.
    PENDING = "pending", "Pending"
    # The worker executed it; ``outcome`` says what was released.
    DONE = "done", "Done"
    # The worker refused it; ``outcome`` says why.
    REFUSED = "refused", "Refused"


class ReclamationRequest(models.Model):
    class Scope(models.TextChoices):
        # Release idle, safe Applications, up to ``limit``.
        IDLE = "idle", "All idle (safe)"
        # Release the selected package refs, if safe.
        SELECTED = "selected", "Selected"

    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.IDLE)
    refs = models.JSONField(default=list, blank=True)
    min_idle_seconds = models.PositiveIntegerField(default=300)
    limit = models.PositiveIntegerField(default=1)
    status = models.CharField(
        max_length=10, choices=ReclamationStatus.choices, default=ReclamationStatus.PENDING
    )
    outcome = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"reclamation #{self.pk} ({self.status})"


class JobRecord(models.Model):
    """What the worker knows of a background job, mirrored for the admin and the API."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job_id = models.CharField(max_length=100, unique=True)
    run = models.ForeignKey("scheduling.Run", on_delete=models.CASCADE, related_name="jobs")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=50)
    state = models.CharField(max_length=20)
    output_bytes = models.PositiveBigIntegerField(default=0)
    output_chunks = models.PositiveIntegerField(default=0)
    output_truncated = models.BooleanField(default=False)
    error = models.JSONField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} job {self.job_id}"


class ThreadMetadata(models.Model):
    """The metadata a LangGraph client keeps on a thread (``agents.protocols.langgraph``: a
    thread is a Session): what ``threads.create`` and ``threads.update`` stored. A thread
    without any has no row."""

    session = models.OneToOneField(
        "scheduling.Session",
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="thread_metadata",
    )
    metadata = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"metadata of thread {self.session_id}"


class McpConnectionKind(models.TextChoices):
    # ``Authorization: Bearer <token>`` on every request to the server.
    BEARER = "bearer", "Bearer token"
    # Headers the user chose (an API key header, several of them).
    HEADERS = "headers", "Headers"
    # OAuth 2.1 tokens from the server's authorization server (refreshed by the worker).
    OAUTH = "oauth", "OAuth"


class McpConnectionQuerySet(models.QuerySet):
    def live(self) -> McpConnectionQuerySet:
        """Connections not revoked."""
        return self.filter(active=True)


class McpConnection(models.Model):
    """A user's credentials for one remote MCP server (by its normalised URL).

    The secret (a JSON object: ``{"token"}``, ``{"headers"}``, or an OAuth connection's
    tokens and authorization server, `agents.services.mcp_oauth`) is Fernet-encrypted
    like model records' keys, read and written through ``secret``; it is never returned,
    shown or logged, and wiped when the connection is revoked.
    """

    objects = McpConnectionQuerySet.as_manager()

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="mcp_connections"
    )
    server_url = models.CharField(max_length=2000)
    # SHA-256 of ``server_url``: a unique index on a 2000-character column does not fit
    # MySQL's key length, its digest does.
    server_key = models.CharField(max_length=64, editable=False)
    kind = models.CharField(max_length=10, choices=McpConnectionKind.choices)
    encrypted_secret = models.TextField(blank=True, default="")
    # True while the connection is live, NULL once revoked: NULLs never collide, so one
    # plain unique constraint keeps one live connection per (owner, server) and lets
    # revoked ones accumulate on every database (MySQL has no partial indexes).
    active = models.BooleanField(null=True, default=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "server_key", "active"], name="mcp_connection_one_live"
            ),
        ]
        ordering = ["-updated_at"]
        verbose_name = "MCP connection"

    def __str__(self) -> str:
        return f"{self.server_url} ({self.kind})"

    @property
    def secret(self) -> dict:
        text = crypto.decrypt(self.encrypted_secret)
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @secret.setter
    def secret(self, value: dict) -> None:
        self.encrypted_secret = crypto.encrypt(json.dumps(value)) if value else ""

    def request_headers(self) -> dict[str, str]:
        """The HTTP headers this connection adds to every request to its server."""
        secret = self.secret
        if self.kind == McpConnectionKind.OAUTH:
            token = secret.get("access_token")
            return {"Authorization": f"Bearer {token}"} if token else {}
        if self.kind == McpConnectionKind.BEARER:
            token = secret.get("token")
            return {"Authorization": f"Bearer {token}"} if token else {}
        return {str(k): str(v) for k, v in (secret.get("headers") or {}).items()}


class _EncryptedJson:
    """A JSON object kept Fernet-encrypted in ``encrypted_<name>`` (never shown)."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __get__(self, row: Any, owner: Any = None) -> Any:
        if row is None:
            return self
        text = crypto.decrypt(getattr(row, self.column))
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def __set__(self, row: Any, value: dict) -> None:
        setattr(row, self.column, crypto.encrypt(json.dumps(value)) if value else "")


class McpOAuthClient(models.Model):
    """Our client's registration with one OAuth authorization server (dynamic client
    registration), shared by every user: one per (issuer, redirect URI). The client
    information (id, secret if any) is encrypted."""

    # SHA-256 of issuer and redirect URI (a unique index on long URLs does not fit MySQL).
    key = models.CharField(max_length=64, unique=True)
    issuer = models.CharField(max_length=2000)
    encrypted_info = models.TextField(blank=True, default="")
    info = _EncryptedJson("encrypted_info")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "MCP OAuth client"

    def __str__(self) -> str:
        return self.issuer


class McpOAuthPending(models.Model):
    """An authorization a run is waiting for: the user opened (or will open) the
    authorization URL; the callback finds this row by its state (only the state's digest
    is kept), exchanges the code with the encrypted PKCE verifier, and deletes it."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(
        "scheduling.Run", on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    server_url = models.CharField(max_length=2000)
    state_hash = models.CharField(max_length=64, unique=True)
    # {"verifier", "server": discovery, "client": McpOAuthClient key, "redirect_uri"}
    encrypted_flow = models.TextField(blank=True, default="")
    flow = _EncryptedJson("encrypted_flow")
    expires_at = models.DateTimeField(db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "MCP OAuth authorization under way"
        verbose_name_plural = "MCP OAuth authorizations under way"

    def __str__(self) -> str:
        return self.server_url
