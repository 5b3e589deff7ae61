"""Migration operations of more than one app.

`covered_foreign_key`: a foreign key whose column leads a composite index loses its own
single-column index — one index fewer to write for every inserted or updated row — without
touching the constraint. Django's own ``AlterField(db_index=False)`` would drop and re-add
the foreign key constraint on PostgreSQL (a scan of the whole table under lock) and rebuild
the table on SQLite; this drops only the index.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def covered_foreign_key(
    app_label: str, model_name: str, name: str, *, to: str, related_name: str
) -> Any:
    """``AlterField`` of the ``CASCADE`` foreign key ``model_name.name`` to ``db_index=False``
    whose database side drops the column's single-column index on PostgreSQL and SQLite.
    MySQL keeps it: InnoDB needs an index on every foreign key (Django never made one of
    its own there), so nothing changes on MySQL."""
    field = models.ForeignKey(
        db_index=False, on_delete=models.CASCADE, related_name=related_name, to=to
    )

    def target(apps: Any) -> tuple[Any, str]:
        model = apps.get_model(app_label, model_name)
        return model, model._meta.get_field(name).column

    def drop(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor == "mysql":
            return
        model, column = target(apps)
        with connection.cursor() as cursor:
            constraints = connection.introspection.get_constraints(cursor, model._meta.db_table)
        for index, info in constraints.items():
            if (
                info["index"]
                and info["columns"] == [column]
                and not (info["unique"] or info["primary_key"] or info["foreign_key"])
            ):
                schema_editor.execute(schema_editor._delete_index_sql(model, index))

    def restore(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "mysql":
            return
        model, _ = target(apps)
        schema_editor.execute(
            schema_editor._create_index_sql(model, fields=[model._meta.get_field(name)])
        )

    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AlterField(model_name=model_name, name=name, field=field)],
        database_operations=[migrations.RunPython(drop, restore)],
    )
