"""Alembic environment: runs on the connection `infra.statedb.migrate` hands over (no ini file)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
context.run_migrations()
