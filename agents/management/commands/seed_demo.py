"""``manage.py seed_demo``: the shared ``scripted`` model record and the ``demo`` package."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from agents.models import Visibility
from agents.services import packages
from pooling.models import ModelRecord, Protocol

DEMO_MANIFEST = {
    "name": "demo",
    "version": "1.0.0",
    "entrypoint": "assistant",
    "agents": {
        "assistant": {
            "model": "scripted",
            "instructions": {"path": "instructions.md"},
            "tools": ["clock", "calculator"],
            "max_steps": 8,
        }
    },
    "files": {
        "instructions.md": (
            "You are the Sage Host demo assistant. Answer briefly. Use the calculator for "
            "arithmetic and the clock for the time.\n"
        )
    },
}


class Command(BaseCommand):
    help = (
        "Create the shared 'scripted' model record and the 'demo' package, shared with "
        "every user (idempotent)."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--owner", default="admin", help="user who owns the demo package (default: admin)"
        )

    def handle(self, *args, **options) -> None:
        _record, created = ModelRecord.objects.get_or_create(
            owner=None,
            name="scripted",
            defaults={"protocol": Protocol.SCRIPTED, "model": "scripted-echo", "options": {}},
        )
        self.stdout.write(f"model record 'scripted': {'created' if created else 'exists'}")
        User = get_user_model()
        try:
            owner = User.objects.get(username=options["owner"])
        except User.DoesNotExist:
            raise CommandError(f"no user {options['owner']!r}; create it first") from None
        package, created = packages.package_create(owner=owner, manifest=DEMO_MANIFEST)
        state = "created" if created else "exists"
        # Every user of the host may open sessions on the demo (their sessions stay theirs).
        packages.package_publish(package, Visibility.EVERYONE)
        self.stdout.write(
            f"package demo@{package.version} ({package.ref[:12]}): {state}, shared with every user"
        )
