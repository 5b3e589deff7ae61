"""ASGI entry point (uvicorn sagehost.asgi:application).

Each request's middleware and view run on a thread of a pool (`sagehost.handler`).
"""

import os

from sageproject import config

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
config.exit_on_errors(config.load(), program="sage-web")

from sagehost.handler import get_application  # noqa: E402

application = get_application()
