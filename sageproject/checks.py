"""System checks: every configuration problem found at start-up, one error each."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register


@register()
def check_sage_configuration(app_configs, **kwargs) -> list[Error]:
    return [
        Error(message, id=f"sageproject.E{index:03d}")
        for index, message in enumerate(settings.SAGE_CONFIG.errors, start=1)
    ]
