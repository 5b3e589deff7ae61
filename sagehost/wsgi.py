"""WSGI entry point."""

import os

from sageproject import config

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
config.exit_on_errors(config.load(), program="sage-web")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
