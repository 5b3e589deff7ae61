from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from scheduling import runs

        # Every SQLite connection reads this host's clock to the microsecond.
        connection_created.connect(runs.register_sqlite_clock, dispatch_uid="sage-sqlite-clock")
