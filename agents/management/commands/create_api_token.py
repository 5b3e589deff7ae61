"""``manage.py create_api_token USER``: print the user's API token (created if missing)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Print USER's API token for 'Authorization: Token <key>' (created if missing)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument(
            "--create-user",
            action="store_true",
            help="create the user (no password) if it does not exist",
        )

    def handle(self, *args, **options) -> None:
        User = get_user_model()
        username = options["username"]
        user = User.objects.filter(username=username).first()
        if user is None:
            if not options["create_user"]:
                raise CommandError(f"no user {username!r} (use --create-user to create one)")
            user = User.objects.create_user(username=username)
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
