"""Cells the admin's lists and pages share, so every list reads alike at 1400 px: short
monospace ids (the whole id in the tooltip), status badges, compact times, durations,
one-line previews and byte sizes. Each returns escaped HTML (``format_html``); none marks
user content safe."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

EMPTY = "—"

# Badge tone of each run, job, archive and reclamation status.
TONES = {
    "completed": "ok",
    "succeeded": "ok",
    "done": "ok",
    "ready": "ok",
    "running": "info",
    "created": "muted",
    "queued": "muted",
    "pending": "muted",
    "suspended": "warn",
    "refused": "warn",
    "failed": "error",
    "killed": "error",
    "cancelled": "muted",
    "interrupted": "muted",
}


def short_id(value: Any) -> str:
    """The first 8 characters of an id (a UUID's first group)."""
    return str(value).replace("-", "")[:8] if value is not None else ""


def id_cell(value: Any, url: str | None = None) -> str:
    """An id as 8 monospace characters, the whole id in its tooltip, a link when ``url``."""
    if value is None or value == "":
        return EMPTY
    if url:
        return format_html(
            '<a class="sage-id" href="{}" title="{}">{}</a>', url, str(value), short_id(value)
        )
    return format_html('<code class="sage-id" title="{}">{}</code>', str(value), short_id(value))


def admin_url(obj_or_label: Any, pk: Any = None) -> str:
    """The admin change page of a model instance, or of ``"app_model"`` and ``pk``."""
    if pk is None:
        opts = obj_or_label._meta
        return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj_or_label.pk])
    return reverse(f"admin:{obj_or_label}_change", args=[pk])


def link_id(label: str, pk: Any) -> str:
    """``id_cell`` linking to the change page of ``label`` (``"scheduling_run"``) ``pk``."""
    return id_cell(pk, admin_url(label, pk)) if pk is not None else EMPTY


def badge(status: Any, tone: str | None = None) -> str:
    """A coloured status label."""
    if status in (None, ""):
        return EMPTY
    text = str(status)
    return format_html(
        '<span class="sage-badge sage-{}">{}</span>', tone or TONES.get(text, "muted"), text
    )


def time_cell(moment: datetime | None) -> str:
    """A time in the current time zone, never wrapped: ``2 Dec 03:26:22`` this year,
    ``2025-12-02 03:26`` before; the exact time in the tooltip."""
    if moment is None:
        return EMPTY
    local = timezone.localtime(moment)
    if local.year == timezone.localtime().year:
        text = f"{local.day} {local:%b %H:%M:%S}"
    else:
        text = f"{local:%Y-%m-%d %H:%M}"
    return format_html(
        '<span class="sage-time" title="{}">{}</span>',
        local.isoformat(timespec="milliseconds"),
        text,
    )


def duration(start: datetime | None, end: datetime | None) -> str:
    """``end - start`` for people (``850 ms``, ``12.3 s``, ``4.2 min``, ``3.1 h``)."""
    if start is None or end is None:
        return EMPTY
    seconds = (end - start).total_seconds()
    if seconds < 1:
        return f"{max(seconds, 0) * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def preview(value: Any, length: int = 60) -> str:
    """A one-line preview of a value (its whole text in the tooltip)."""
    if value in (None, ""):
        return EMPTY
    text = value if isinstance(value, str) else str(value)
    line = " ".join(text.split())
    short = line if len(line) <= length else line[: length - 1] + "…"
    return format_html('<span class="sage-preview" title="{}">{}</span>', text[:2000], short)


def error_code(error: Any) -> str:
    """The code of an error record, in red, its message in the tooltip."""
    if not isinstance(error, dict) or not error.get("code"):
        return EMPTY
    return format_html(
        '<code class="sage-error-code" title="{}">{}</code>',
        str(error.get("message") or ""),
        str(error["code"]),
    )


def size(count: int | None) -> str:
    """A byte count for people (``4.0 KiB``), the exact count in the tooltip."""
    if count is None:
        return EMPTY
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    text = f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
    return format_html('<span class="sage-num" title="{} bytes">{}</span>', count, text)


# --- list columns: ``created = time_column("created_at")`` in a ModelAdmin's body ---------


def time_column(field: str, description: str | None = None) -> Any:
    """A sortable column showing the time ``field`` with ``time_cell``."""

    @admin.display(description=description or field.removesuffix("_at"), ordering=field)
    def column(modeladmin: Any, obj: Any) -> str:
        return time_cell(getattr(obj, field))

    return column


def badge_column(field: str = "status", description: str | None = None) -> Any:
    """A sortable column showing ``field`` as a status badge."""

    @admin.display(description=description or field, ordering=field)
    def column(modeladmin: Any, obj: Any) -> str:
        return badge(getattr(obj, field))

    return column


def error_column(field: str = "error") -> Any:
    """A column showing the code of the error record ``field``."""

    @admin.display(description="error")
    def column(modeladmin: Any, obj: Any) -> str:
        return error_code(getattr(obj, field))

    return column


def id_column(field: str, description: str, label: str | None = None) -> Any:
    """A sortable column showing the id ``field`` short, linking to ``label``'s change page
    (``"scheduling_run"``) when given."""

    @admin.display(description=description, ordering=field.removesuffix("_id"))
    def column(modeladmin: Any, obj: Any) -> str:
        value = getattr(obj, field)
        return link_id(label, value) if label else id_cell(value)

    return column
