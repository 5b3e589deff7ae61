from __future__ import annotations

from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agents"

    def ready(self) -> None:
        # A run's terminal transition (scheduling.runs) writes its archive row in the same
        # transaction; the archive belongs to this app, so it registers the writer.
        from agents.services import archive_terminal
        from scheduling import runs

        runs.set_archiver(archive_terminal)
