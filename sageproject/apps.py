from __future__ import annotations

from django.apps import AppConfig


class SageProjectConfig(AppConfig):
    """The kernel every app imports: settings, errors, database helpers, API plumbing."""

    name = "sageproject"
    verbose_name = "Sage Host"

    def ready(self) -> None:
        from sageproject import checks  # noqa: F401  (registers the system checks)
