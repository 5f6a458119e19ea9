"""Audit integrity on the real stack (PostgreSQL, Redis, a worker subprocess, gunicorn).

1. The rows cannot be changed by the application: the web and the worker run as a runtime role that
   does not own the tables (created by `manage.py grant_runtime_role`; migrations ran as the owner).
   It is refused UPDATE of a final row (trigger), DELETE and TRUNCATE (no privilege), and cannot switch
   the triggers off, drop them, replace their function or make tables. The owner itself is still refused
   by the triggers, and so is a non-superuser given every table privilege by a careless grant.
2. For sampled answers, the sha256 in the audit row equals the sha256 of the blob bytes in storage,
   and equals what the response said it served.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
SAMPLES = 1000 if FULL else 24


def _complete(stack, model: str, prompt: str) -> httpx.Response:
    return httpx.post(stack.url + "/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {stack.seed['keys']['a']}"},
                      json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})


@pytest.fixture(scope="module")
def answered(rel_stack):
    """SAMPLES answers over the stack's adapters, 8 at a time: [(model, response)]."""
    models = sorted(rel_stack.seed["adapters"])
    calls = [(models[i % len(models)], f"Sample {i} says") for i in range(SAMPLES)]
    with ThreadPoolExecutor(8) as pool:
        return list(zip([m for m, _ in calls], pool.map(lambda c: _complete(rel_stack, *c), calls), strict=True))


def _rolled_back(url: str):
    """A connection to `url`, in a transaction rolled back after."""
    conn = psycopg.connect(url, row_factory=dict_row)
    yield conn
    conn.rollback()
    conn.close()


@pytest.fixture
def app_conn(rel_stack):
    """A connection as the application's runtime role (DATABASE_URL), in a transaction rolled back after."""
    yield from _rolled_back(rel_stack.db_url)


@pytest.fixture
def owner_conn(rel_stack):
    """A connection as the owner of the tables (MIGRATION_DATABASE_URL), rolled back after."""
    yield from _rolled_back(rel_stack.owner_url)


def _final_row(conn) -> dict:
    row = conn.execute("SELECT id, request_id FROM gateway_auditrecord WHERE status <> 'pending' LIMIT 1").fetchone()
    assert row is not None, "no final audit row to tamper with"
    return row


def _refused(conn, sql: str, params=()) -> str:
    """Run `sql` in a savepoint; return the error it raised (the test fails if it did not raise)."""
    with pytest.raises(psycopg.Error) as caught:
        with conn.transaction():
            conn.execute(sql, params)
    return str(caught.value)


def test_the_application_runs_as_a_role_that_does_not_own_the_tables(rel_stack, answered, app_conn):
    me = app_conn.execute("SELECT current_user AS u, rolsuper, rolcreaterole, rolcreatedb FROM pg_roles "
                          "WHERE rolname = current_user").fetchone()
    assert me["u"] == rel_stack.role and not (me["rolsuper"] or me["rolcreaterole"] or me["rolcreatedb"])
    owners = {r["tableowner"] for r in app_conn.execute(
        "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'").fetchall()}
    assert owners and rel_stack.role not in owners  # migrate ran as the owner, not as DATABASE_URL's role
    # and the stack works as this role: the sampled answers were served, audited and finalised by it
    assert all(r.status_code == 200 for _, r in answered)
    assert "checked: " in rel_stack.granted and "no DELETE, no TRUNCATE" in rel_stack.granted


def test_the_application_role_cannot_change_audit_rows(rel_stack, answered, app_conn):
    row = _final_row(app_conn)
    count = app_conn.execute("SELECT count(*) AS n FROM gateway_auditrecord").fetchone()["n"]
    assert "final and never changes" in _refused(
        app_conn, "UPDATE gateway_auditrecord SET weights_sha256 = %s WHERE id = %s", ("0" * 64, row["id"]))
    assert "permission denied" in _refused(app_conn, "DELETE FROM gateway_auditrecord WHERE id = %s", (row["id"],))
    assert "permission denied" in _refused(app_conn, "TRUNCATE gateway_auditrecord CASCADE")
    # the test-database escape hatch changes nothing for it
    app_conn.execute("SET lorafleet.allow_test_flush = 'on'")
    assert "permission denied" in _refused(app_conn, "TRUNCATE gateway_auditrecord CASCADE")
    assert app_conn.execute("SELECT count(*) AS n FROM gateway_auditrecord").fetchone()["n"] == count


def test_the_application_role_cannot_switch_the_triggers_off(rel_stack, answered, app_conn):
    """The gap the old strict xfail recorded: the app connected as the owner, who may disable triggers."""
    assert "must be owner" in _refused(app_conn, "ALTER TABLE gateway_auditrecord DISABLE TRIGGER audit_append_only")
    assert "must be owner" in _refused(app_conn, "ALTER TABLE gateway_auditrecord DISABLE TRIGGER ALL")
    assert "must be owner" in _refused(app_conn, "DROP TRIGGER audit_no_truncate ON gateway_auditrecord")
    assert "permission denied" in _refused(app_conn, "SET session_replication_role = replica")
    assert "permission denied for schema public" in _refused(  # (not even the chance to be "must be owner")
        app_conn, "CREATE OR REPLACE FUNCTION lorafleet_audit_append_only() RETURNS trigger AS "
                  "$$ BEGIN RETURN NEW; END; $$ LANGUAGE plpgsql")
    assert "permission denied" in _refused(app_conn, "CREATE TABLE audit_copy (id int)")
    assert "must be owner" in _refused(app_conn, "ALTER TABLE gateway_auditrecord OWNER TO CURRENT_USER")
    # still on: a final row stays final after all those attempts
    row = _final_row(app_conn)
    assert "final and never changes" in _refused(
        app_conn, "UPDATE gateway_auditrecord SET status = 'pending' WHERE id = %s", (row["id"],))


def test_the_owner_is_refused_by_the_triggers_too(rel_stack, answered, owner_conn):
    row = _final_row(owner_conn)
    assert "final and never changes" in _refused(
        owner_conn, "UPDATE gateway_auditrecord SET weights_sha256 = %s WHERE id = %s", ("0" * 64, row["id"]))
    assert "DELETE is not allowed" in _refused(owner_conn, "DELETE FROM gateway_auditrecord WHERE id = %s", (row["id"],))
    assert "TRUNCATE is not allowed" in _refused(owner_conn, "TRUNCATE gateway_auditrecord CASCADE")


def _privileges(conn, role: str) -> set[tuple[str, str]]:
    return {(r["table_name"], r["privilege_type"]) for r in conn.execute(
        "SELECT table_name, privilege_type FROM information_schema.role_table_grants WHERE grantee = %s",
        (role,)).fetchall()}


def test_grant_runtime_role_is_idempotent_and_takes_back_a_careless_grant(rel_stack, answered, owner_conn):
    import subprocess

    from tests.e2e.conftest import PYTHON, REPO

    before = _privileges(owner_conn, rel_stack.role)
    assert ("gateway_auditrecord", "INSERT") in before and ("adapters_adapter", "DELETE") in before
    assert not {(t, p) for t, p in before if p == "TRUNCATE" or (t == "gateway_auditrecord" and p == "DELETE")}
    with psycopg.connect(rel_stack.owner_url, autocommit=True) as admin:  # what a careless operator might do
        admin.execute(f'GRANT ALL ON gateway_auditrecord, adapters_adapter TO "{rel_stack.role}"')
    out = subprocess.run([PYTHON, "manage.py", "grant_runtime_role"], cwd=REPO, env=rel_stack.env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"role {rel_stack.role}: exists" in out.stdout and "no DELETE, no TRUNCATE" in out.stdout
    owner_conn.rollback()
    assert _privileges(owner_conn, rel_stack.role) == before
    assert rel_stack.db_url.split("@")[0].split(":")[-1] not in out.stdout + out.stderr  # the secret is never printed


def test_grant_runtime_role_refuses_to_make_the_owner_the_runtime_role(rel_stack):
    import subprocess

    from tests.e2e.conftest import PYTHON, REPO

    out = subprocess.run([PYTHON, "manage.py", "grant_runtime_role"], cwd=REPO, capture_output=True, text=True,
                         env={**rel_stack.env, "DATABASE_URL": rel_stack.owner_url}, timeout=120)
    assert out.returncode != 0 and "are the same role" in out.stderr, out.stdout + out.stderr[-2000:]


@pytest.fixture
def limited_role(rel_stack, owner_conn):
    """A non-superuser role with every privilege on the audit table (what a careless grant would give);
    the owner's connection acts as it through SET ROLE. Dropped afterwards."""
    name = f"lorafleet_rel_any_{secrets.token_hex(3)}"
    with psycopg.connect(rel_stack.owner_url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{name}" NOSUPERUSER NOCREATEDB NOCREATEROLE')
        admin.execute(f'GRANT USAGE ON SCHEMA public TO "{name}"')
        admin.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON gateway_auditrecord TO "{name}"')
    owner_conn.execute(f'SET ROLE "{name}"')
    yield name
    owner_conn.rollback()
    with psycopg.connect(rel_stack.owner_url, autocommit=True) as admin:
        admin.execute(f'DROP OWNED BY "{name}"')
        admin.execute(f'DROP ROLE "{name}"')


def test_a_non_superuser_role_is_refused_and_cannot_switch_the_triggers_off(rel_stack, answered, owner_conn, limited_role):
    assert owner_conn.execute("SELECT current_user AS u").fetchone()["u"] == limited_role
    assert owner_conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"] is False
    row = _final_row(owner_conn)
    assert "final and never changes" in _refused(
        owner_conn, "UPDATE gateway_auditrecord SET status = 'pending' WHERE id = %s", (row["id"],))
    assert "DELETE is not allowed" in _refused(owner_conn, "DELETE FROM gateway_auditrecord WHERE id = %s", (row["id"],))
    assert "TRUNCATE is not allowed" in _refused(owner_conn, "TRUNCATE gateway_auditrecord")
    assert "permission denied" in _refused(owner_conn, "SET session_replication_role = replica")
    assert "must be owner" in _refused(owner_conn, "ALTER TABLE gateway_auditrecord DISABLE TRIGGER audit_append_only")
    assert "must be owner" in _refused(owner_conn, "DROP TRIGGER audit_append_only ON gateway_auditrecord")


def test_sampled_audit_sha256_equals_the_stored_blob(rel_stack, answered):
    failed = [(m, r.status_code, r.text[:200]) for m, r in answered if r.status_code != 200]
    assert not failed, failed[:5]
    versions = {name: a["versions"][0] for name, a in rel_stack.seed["adapters"].items()}
    blob_sha = {name: hashlib.sha256((rel_stack.storage / v["storage_key"]).read_bytes()).hexdigest()
                for name, v in versions.items()}
    ids = [r.headers["X-Lorafleet-Request-Id"] for _, r in answered]
    with psycopg.connect(rel_stack.db_url, row_factory=dict_row) as conn:
        rows = conn.execute("SELECT request_id::text AS rid, adapter_name, status, weights_sha256, expected_sha256 "
                            "FROM gateway_auditrecord WHERE request_id::text = ANY(%s)", (ids,)).fetchall()
    by_id = {row["rid"]: row for row in rows}
    assert len(rows) == len(ids) == len(set(ids)) == SAMPLES  # exactly one row per answer
    for model, response in answered:
        row = by_id[response.headers["X-Lorafleet-Request-Id"]]
        served = response.json()["lorafleet"]["weights_sha256"]
        assert row["status"] == "ok" and row["adapter_name"] == model
        assert row["weights_sha256"] == row["expected_sha256"] == served == blob_sha[model] == versions[model]["sha256"]
    print(f"\naudit integrity: {SAMPLES} answers, {len(blob_sha)} blobs, every audit sha256 = stored blob sha256")
