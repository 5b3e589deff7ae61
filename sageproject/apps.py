from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig


class SageProjectConfig(AppConfig):
    name = "sageproject"
    verbose_name = "Sage Host"

    def ready(self) -> None:
        from sageproject import checks  # noqa: F401  (registers the system checks)


class SageAdminConfig(AdminConfig):
    default_site = "sageproject.admin.SageAdminSite"
