from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created
        from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteWrapper

        from scheduling import runs

        # Every SQLite connection reads this host's clock to the microsecond. Only SQLite's
        # wrapper is the signal's sender here: a PostgreSQL connection from Django's pool
        # sends ``connection_created`` at every checkout, for nothing to do.
        connection_created.connect(
            runs.register_sqlite_clock, sender=SQLiteWrapper, dispatch_uid="sage-sqlite-clock"
        )
