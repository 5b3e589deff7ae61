"""ASGI entry point (uvicorn sageproject.asgi:application).

Each request's middleware and view run on a thread of a pool (`sageproject.handler`).
"""

import os

from sageproject import config

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
config.exit_on_errors(config.load(), program="sage-web")

from sageproject.handler import get_application  # noqa: E402

application = get_application()
