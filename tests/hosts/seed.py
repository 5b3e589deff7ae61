"""What the simulated-host tests write to the site's database: its schema, users with a
package on a shared scripted model, and runs admitted through the service every door uses
(``agents.services.run_submit``).

``python -m tests.hosts.seed`` (`tests.hosts.netns.Site.call`) sets Django up once on the
site's database (``DATABASE_URL``) and then answers requests, one JSON line each on stdin
(``{"function": name, "arguments": {...}}``), with one line on stdout: ``RESULT=<json>`` or
``ERROR=<traceback as json>``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def migrate() -> bool:
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    return True


def setup(*, users: list[str], models: dict[str, dict[str, Any]], manifest: dict) -> dict:
    """Shared scripted model records ``{name: options}``, and ``users`` each owning the
    package ``manifest``; returns ``{"users": {name: id}}``."""
    from django.contrib.auth import get_user_model

    from agents.services import packages
    from pooling.models import ModelRecord, Protocol

    for name, options in models.items():
        ModelRecord.objects.update_or_create(
            owner=None,
            name=name,
            defaults={"protocol": Protocol.SCRIPTED, "model": name, "options": options},
        )
    made = {}
    for username in users:
        user, _ = get_user_model().objects.get_or_create(username=username)
        packages.package_create(owner=user, manifest=manifest)
        made[username] = user.pk
    return {"users": made}


def submit(*, plan: list[list[Any]], package: str, text: str = "run") -> dict:
    """For each ``[username, sessions, runs per session]`` of ``plan``: new sessions on
    ``package`` and their runs, admitted in order; returns ``{"runs": [ids], "sessions":
    [ids]}`` in admission order."""
    from django.contrib.auth import get_user_model

    from agents import services

    runs: list[str] = []
    sessions: list[str] = []
    for username, session_count, per_session in plan:
        user = get_user_model().objects.get(username=username)
        for s in range(session_count):
            session = services.session_create(owner=user, package=package, agent="assistant")
            sessions.append(str(session.pk))
            for r in range(per_session):
                run, _ = services.run_submit(
                    owner=user, session_id=session.pk, input=f"{text} {username} {s} {r}"
                )
                runs.append(str(run.pk))
    return {"runs": runs, "sessions": sessions}


def serve() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sageproject.settings")
    import django

    django.setup()
    functions = {"migrate": migrate, "setup": setup, "submit": submit}
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = functions[request["function"]](**request["arguments"])
        except Exception:
            print("ERROR=" + json.dumps(traceback.format_exc()), flush=True)
        else:
            print("RESULT=" + json.dumps(result), flush=True)


if __name__ == "__main__":
    serve()
