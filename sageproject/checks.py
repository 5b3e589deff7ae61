"""System checks: every configuration problem found at start-up, one error each.

Each error carries the id of the rule it breaks (``sageproject.config``); ids are stable,
so scripts and runbooks may rely on them (docs/OPERATIONS.md, "System checks").
"""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register


@register()
def check_sage_configuration(app_configs, **kwargs) -> list[Error]:
    return [Error(problem.message, id=problem.check_id) for problem in settings.SAGE_CONFIG.errors]
