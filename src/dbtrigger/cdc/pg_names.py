"""The watched tables' names on PostgreSQL: ``schema.table`` parsed, checked as
identifiers and quoted for statements. Below the setup, identity and publication
modules, which all name tables, so that none of them imports another for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from dbtrigger.errors import ConfigurationError
from dbtrigger.names import validate_sql_identifier


@dataclass(frozen=True, order=True)
class TableName:
    schema: str
    name: str

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def identifier(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    @classmethod
    def parse(cls, text: str) -> TableName:
        if not isinstance(text, str):
            raise ConfigurationError(f"a table must be named by a string, got {text!r}")
        schema, _, name = text.rpartition(".")
        schema = schema or "public"
        return cls(
            validate_sql_identifier(schema, "schema"), validate_sql_identifier(name, "table")
        )


def parse_tables(tables: Sequence[str]) -> tuple[TableName, ...]:
    if isinstance(tables, str) or not tables:
        raise ConfigurationError(
            "tables= must be a non-empty list of table names (e.g. ['public.orders'])"
        )
    parsed = tuple(TableName.parse(t) for t in tables)
    if len(set(parsed)) != len(parsed):
        raise ConfigurationError(f"tables= names a table twice: {list(tables)}")
    return parsed


__all__ = ["TableName", "parse_tables"]
