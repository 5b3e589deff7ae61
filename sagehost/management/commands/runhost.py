"""``manage.py runhost`` (what ``make run`` calls): migrate, seed, serve web + worker.

First run creates a local superuser ``admin`` with a random password and an API token,
prints them once and keeps them in the git-ignored ``.local/admin_credentials``. Ctrl-C or
SIGTERM (``kill``, a service manager's stop) stops both processes cleanly: the worker gets
its grace period (``SAGE_SHUTDOWN_GRACE_SECONDS``) and requeues what it could not finish.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Migrate, seed the demo package, then run the web server and the worker."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))

    def handle(self, *args, **options) -> None:
        # SIGTERM stops the host as Ctrl-C does; by default it would end this process alone
        # and leave the web process and the worker running.
        signal.signal(signal.SIGTERM, _interrupt)
        host, port = options["host"], options["port"]
        self.stdout.write("Migrating the database …")
        call_command("migrate", interactive=False, verbosity=0)
        password, token = self._ensure_admin()
        call_command("seed_demo", owner="admin", verbosity=0, stdout=open(os.devnull, "w"))

        base = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        manage = str(Path(settings.BASE_DIR) / "manage.py")
        children: list[subprocess.Popen] = []
        try:
            # Started inside the ``try``: a signal between the two starts stops the first.
            web = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "sagehost.asgi:application",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--no-access-log",
                    "--lifespan",
                    "off",
                ],
                env=env,
            )
            children.append(web)
            children.append(subprocess.Popen([sys.executable, manage, "runworker"], env=env))
            if not self._wait_until_up(f"{base}/healthz", web):
                raise CommandError(f"the web server did not start on {base}")
            self._banner(base, password, token)
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            raise CommandError("a process stopped unexpectedly; see the messages above")
        except KeyboardInterrupt:
            self.stdout.write("\nStopping (the worker finishes or requeues running runs) …")
        finally:
            self._stop(children)

    def _ensure_admin(self) -> tuple[str | None, str]:
        User = get_user_model()
        path = Path(settings.LOCAL_DIR) / "admin_credentials"
        user = User.objects.filter(username="admin").first()
        password = None
        if user is None:
            password = secrets.token_urlsafe(12)
            user = User.objects.create_superuser("admin", "admin@localhost", password)
        token, _ = Token.objects.get_or_create(user=user)
        if password is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(
                    {"username": "admin", "password": password, "token": token.key},
                    handle,
                    indent=2,
                )
        return password, token.key

    def _wait_until_up(self, url: str, web: subprocess.Popen, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if web.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return True
            except OSError:
                time.sleep(0.2)
        return False

    def _banner(self, base: str, password: str | None, token: str) -> None:
        creds = Path(settings.LOCAL_DIR) / "admin_credentials"
        if password:
            login = f"user admin, password {password}  (also kept in {creds})"
        elif creds.exists():
            login = f"user admin; password and token in {creds}"
        else:
            login = "user admin (created outside make run: `manage.py changepassword admin`)"
        curl = (
            f"TOKEN={token}\n"
            f'SESSION=$(curl -s -H "Authorization: Token $TOKEN" -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"package": "demo", "agent": "assistant"}}\' {base}/api/v1/sessions/ \\\n'
            f"  | python3 -c \"import sys, json; print(json.load(sys.stdin)['id'])\")\n"
            f'curl -s -H "Authorization: Token $TOKEN" -H "Content-Type: application/json" \\\n'
            f'  -d "{{\\"session\\": \\"$SESSION\\", \\"input\\": \\"please calculate (2+3)*4\\"}}" '
            f"{base}/api/v1/runs/; echo\n"
            f'sleep 1; curl -s -H "Authorization: Token $TOKEN" '
            f'"{base}/api/v1/sessions/$SESSION/events/"\n'
        )
        self.stdout.write(self.style.SUCCESS("\nSage Host is running."))
        self.stdout.write(f"  Admin:    {base}/admin/   ({login})")
        self.stdout.write(f"  API docs: {base}/api/docs/")
        self.stdout.write(f"  Token:    {token}")
        self.stdout.write("\nTry it (submit a run, then read its events):\n")
        self.stdout.write(curl)
        self.stdout.write("Press Ctrl-C to stop.\n")

    def _stop(self, children: list[subprocess.Popen]) -> None:
        # Stopping is under way: a second Ctrl-C or SIGTERM must not leave the children
        # behind (the wait below is bounded by the worker's grace period).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + settings.SAGE["SAGE_SHUTDOWN_GRACE_SECONDS"] + 10
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
