from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig


class SageHostConfig(AppConfig):
    """The top layer: URLs, the web process, the admin site, health and metrics, and the
    commands that run the host (runhost, runweb, doctor)."""

    name = "sagehost"
    verbose_name = "Sage Host (the host)"


class SageAdminConfig(AdminConfig):
    default_site = "sagehost.admin.SageAdminSite"
