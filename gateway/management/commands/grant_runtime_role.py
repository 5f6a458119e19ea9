"""`manage.py grant_runtime_role`: create (or refresh) the PostgreSQL role the web and workers run as.

The tables belong to the role that runs migrations (MIGRATION_DATABASE_URL). An owner can
`ALTER TABLE … DISABLE TRIGGER`, so the audit log's append-only triggers bind only a role that does
not own the tables: the runtime role, named by DATABASE_URL. This command, run as the owner right
after `migrate`, makes that role exist and gives it exactly what the application needs:

- LOGIN (with DATABASE_URL's password, if it has one), never SUPERUSER, CREATEDB or CREATEROLE;
- CONNECT on the database, USAGE on the schema (no CREATE: it cannot make tables or functions);
- SELECT, INSERT, UPDATE, DELETE on every table, and no TRUNCATE, REFERENCES or TRIGGER;
- on the audit table only SELECT, INSERT, UPDATE (rows are finalised once; the triggers refuse the rest);
- USAGE and SELECT on the sequences;
- the same by default on tables and sequences the owner creates later (future migrations).

Idempotent: privileges are revoked and granted again in one transaction, so a careless earlier grant
(TRUNCATE, say) is taken back, and running it twice changes nothing. It prints what it did; it never
prints a password.
"""
from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from config.env import database_from_url

TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")
AUDIT_PRIVILEGES = ("SELECT", "INSERT", "UPDATE")


def _parse(name: str, url: str) -> dict:
    if not url:
        raise CommandError(f"{name} is not set: this command needs the owner (MIGRATION_DATABASE_URL) and the "
                           f"runtime role (DATABASE_URL), both postgres:// URLs of the same database.")
    try:
        db = database_from_url(name, url)
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from None
    if db["ENGINE"] != "django.db.backends.postgresql":
        raise CommandError(f"{name} must be a postgres:// URL: the runtime role exists only on PostgreSQL "
                           f"(the embedded SQLite default has no roles).")
    return db


def _conninfo(db: dict) -> dict:
    info = {"dbname": db["NAME"], "user": db["USER"] or None, "password": db["PASSWORD"] or None,
            "host": db["HOST"] or None, "port": db["PORT"] or None, "connect_timeout": 10}
    info.update(db["OPTIONS"])
    return {k: v for k, v in info.items() if v is not None}


class Command(BaseCommand):
    help = ("Create or refresh the non-owner PostgreSQL role of DATABASE_URL, granted what the app needs and "
            "nothing that could change audit rows (run as the owner of MIGRATION_DATABASE_URL, after migrate).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--owner-url", default=None,
                            help="the owner's URL (default: $MIGRATION_DATABASE_URL)")
        parser.add_argument("--runtime-url", default=None,
                            help="the runtime role's URL (default: $DATABASE_URL)")
        parser.add_argument("--schema", default="public")

    def handle(self, *args, **opts) -> None:
        import psycopg
        from psycopg import sql

        from gateway.models import AuditRecord

        owner = _parse("MIGRATION_DATABASE_URL", opts["owner_url"] or os.environ.get("MIGRATION_DATABASE_URL", ""))
        runtime = _parse("DATABASE_URL", opts["runtime_url"] or os.environ.get("DATABASE_URL", ""))
        if owner["NAME"] != runtime["NAME"]:
            raise CommandError(f"MIGRATION_DATABASE_URL and DATABASE_URL name different databases "
                               f"({owner['NAME']!r}, {runtime['NAME']!r}); only the role should differ.")
        role = runtime["USER"]
        if not role:
            raise CommandError("DATABASE_URL names no user: put the runtime role in it (postgres://ROLE:PASSWORD@…).")
        schema = opts["schema"]
        audit_table = AuditRecord._meta.db_table
        ident = sql.Identifier(role)
        out = self.stdout.write

        try:
            conn = psycopg.connect(**_conninfo(owner), autocommit=True)
        except psycopg.Error as exc:
            raise CommandError(f"cannot connect with MIGRATION_DATABASE_URL: {exc}".strip()) from None
        with conn:
            owner_role = conn.execute("SELECT current_user").fetchone()[0]
            if owner_role == role:
                raise CommandError(f"DATABASE_URL and MIGRATION_DATABASE_URL are the same role ({role!r}): the app "
                                   f"would own the tables and could switch the audit triggers off. Give DATABASE_URL "
                                   f"a role of its own.")
            found = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s",
                                 (role,)).fetchone()
            with conn.transaction():
                if found is None:
                    conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
                                         "NOBYPASSRLS").format(ident))
                    out(f"role {role}: created (LOGIN, NOSUPERUSER, NOCREATEDB, NOCREATEROLE)")
                else:
                    if found[0]:
                        raise CommandError(f"role {role!r} is a superuser: it can switch the audit triggers off. "
                                           f"Use a role that is not (ALTER ROLE {role} NOSUPERUSER).")
                    conn.execute(sql.SQL("ALTER ROLE {} LOGIN NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS")
                                 .format(ident))
                    out(f"role {role}: exists; LOGIN, NOCREATEDB, NOCREATEROLE ensured")
                if runtime["PASSWORD"]:
                    conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(ident, sql.Literal(runtime["PASSWORD"])))
                    out(f"role {role}: password set from DATABASE_URL")
                member_of_owner = conn.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (role, owner_role)).fetchone()[0]
                if member_of_owner:
                    raise CommandError(f"role {role!r} is a member of the owner {owner_role!r}, so it acts as the owner "
                                       f"(REVOKE {owner_role} FROM {role}).")
                owned = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tableowner = %s",
                                     (schema, role)).fetchone()[0]
                if owned:
                    raise CommandError(f"role {role!r} owns {owned} table(s) in schema {schema!r}: an owner can switch "
                                       f"the audit triggers off. Reassign them to {owner_role!r} (REASSIGN OWNED).")
                tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s", (schema,)).fetchone()[0]
                has_audit = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                         (f"{schema}.{audit_table}",)).fetchone()[0]
                if not has_audit:
                    raise CommandError(f"no table {schema}.{audit_table}: run `manage.py migrate` (as the owner) first.")

                db_ident, schema_ident = sql.Identifier(runtime["NAME"]), sql.Identifier(schema)
                privs = sql.SQL(", ").join(sql.SQL(p) for p in TABLE_PRIVILEGES)
                audit_privs = sql.SQL(", ").join(sql.SQL(p) for p in AUDIT_PRIVILEGES)
                audit_ident = sql.Identifier(schema, audit_table)
                for stmt in (
                    "GRANT CONNECT ON DATABASE {db} TO {role}",
                    "REVOKE CREATE ON SCHEMA {schema} FROM {role}",
                    "GRANT USAGE ON SCHEMA {schema} TO {role}",
                    "REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}",
                    "GRANT {privs} ON ALL TABLES IN SCHEMA {schema} TO {role}",
                    "REVOKE ALL ON {audit} FROM {role}",
                    "GRANT {audit_privs} ON {audit} TO {role}",
                    "REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}",
                    "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
                    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema} REVOKE ALL ON TABLES FROM {role}",
                    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema} GRANT {privs} ON TABLES TO {role}",
                    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema} REVOKE ALL ON SEQUENCES FROM {role}",
                    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema} "
                    "GRANT USAGE, SELECT ON SEQUENCES TO {role}",
                ):
                    conn.execute(sql.SQL(stmt).format(db=db_ident, schema=schema_ident, role=ident, privs=privs,
                                                      audit=audit_ident, audit_privs=audit_privs,
                                                      owner=sql.Identifier(owner_role)))
            out(f"granted {', '.join(TABLE_PRIVILEGES)} on {tables} tables in schema {schema} (no TRUNCATE)")
            out(f"granted {', '.join(AUDIT_PRIVILEGES)} only on {audit_table} (no DELETE, no TRUNCATE)")
            out(f"granted USAGE, SELECT on the sequences; the same by default on what {owner_role} creates later")

            check = {p: conn.execute("SELECT has_table_privilege(%s, %s, %s)", (role, f"{schema}.{audit_table}", p))
                     .fetchone()[0] for p in ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")}
            if not (check["SELECT"] and check["INSERT"] and check["UPDATE"]) or check["DELETE"] or check["TRUNCATE"]:
                raise CommandError(f"unexpected privileges of {role!r} on {audit_table} after granting: {check} "
                                   f"(is it granted through PUBLIC or another role?)")
            table_owner = conn.execute("SELECT tableowner FROM pg_tables WHERE schemaname = %s AND tablename = %s",
                                       (schema, audit_table)).fetchone()[0]
            out(f"checked: {role} may SELECT, INSERT, UPDATE {audit_table}; may not DELETE or TRUNCATE it; "
                f"does not own it ({table_owner} does)")
