"""ASGI entry point (uvicorn sageproject.asgi:application)."""

import os

from sageproject import config

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
config.exit_on_errors(config.load(), program="sage-web")

from django.core.asgi import get_asgi_application  # noqa: E402

application = get_asgi_application()
