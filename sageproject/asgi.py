"""ASGI entry point (uvicorn sageproject.asgi:application)."""

import os

from sageproject import config

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
# The REST API's views run on a thread pool under ASGI (see sageproject.api.concurrent_view).
os.environ["SAGE_ASGI"] = "1"
config.exit_on_errors(config.load(), program="sage-web")

from django.core.asgi import get_asgi_application  # noqa: E402

application = get_asgi_application()
