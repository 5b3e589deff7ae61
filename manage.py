#!/usr/bin/env python3
"""Django's command-line utility for Sage Host."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
    from sageproject import config

    # A bad SAGE_* value stops every command with one clear line, before Django starts.
    config.exit_on_errors(config.load(), program="manage.py")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
