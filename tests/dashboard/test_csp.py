"""The Content-Security-Policy, checked where it matters: in Debian's chromium, on every dashboard page.

Every page is served with the policy (config/settings.py: scripts and styles from this origin only, no inline
code, no framing) and renders with no violation: nothing reported to a `securitypolicyviolation` listener
(installed before any page script runs) and no CSP message in the console. The pages' scripts keep working under
it: the tenant switcher submits on change, confirmations ask, copy buttons copy. A control shows the check
catches what the policy refuses (an inline script, a style attribute), so a clean page is not a blind check.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.dashboard.test_browser import browser, log_in, page  # noqa: F401 (fixtures: one chromium launch recipe)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

WATCH_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective} blocked ${e.blockedURI || "inline"} (${e.sourceFile}:${e.lineNumber})`);
});
"""


@pytest.fixture
def watched(page):  # noqa: F811 (the imported fixture)
    """The page, with every CSP violation and console error recorded: `watched.problems()` lists them."""
    page.context.add_init_script(WATCH_VIOLATIONS)  # runs before the page's own scripts, exempt from its CSP
    console: list[str] = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}") if msg.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda exc: console.append(f"pageerror: {exc}"))

    def problems() -> list[str]:
        seen = page.evaluate("window.__csp || []")
        return seen + [line for line in console if "Content Security Policy" in line or line.startswith("pageerror")]

    page.problems = problems
    page.console = console
    return page


def visit(tab, url: str, expect_status: int = 200) -> None:
    response = tab.goto(url)
    assert response.status == expect_status, f"{url}: {response.status}"
    policy = response.headers.get("content-security-policy", "")
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, f"{url}: {policy!r}"
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    tab.wait_for_load_state("load")
    assert tab.problems() == [], f"{url}: {tab.problems()}"


@pytest.fixture
def busy_world(world):
    """The world with traffic (charts draw bars), an invitation for alice, alice in two tenants (the switcher
    shows) and staff (the operator page)."""
    from gateway.models import AuditRecord
    from tenants.models import Role
    from tenants.services import add_member, do_invite

    now = timezone.now()
    for i in range(30):
        AuditRecord.objects.create(
            route="/v1/chat/completions", tenant=world.acme, adapter=world.acme_adapter, adapter_name="support-bot",
            version_number=2, created_at=now - timedelta(minutes=37 * i), status="error" if i % 11 == 0 else "ok",
            prompt_tokens=20 + i, completion_tokens=10 + i % 7, total_seconds=0.05 + (i % 9) / 40,
            key_prefix=world.acme_key.prefix, weights_sha256="b" * 64,
        )
    add_member(world.globex, world.alice, Role.MEMBER)
    do_invite(world.globex, "bob", Role.VIEWER, actor=world.charlie)
    world.alice.is_staff = True
    world.alice.save()
    return world


def test_every_dashboard_page_renders_with_no_csp_violation(transactional_db, watched, busy_world):
    w = busy_world
    visit(watched, "/login/")
    log_in(watched, "alice", "alice-password-1")
    pages = ["/adapters/", "/adapters/new/", f"/adapters/{w.acme_adapter.pk}/",
             f"/adapters/{w.acme_adapter.pk}/upload/", f"/adapters/{w.acme_adapter.pk}/versions/1/activate/",
             f"/adapters/{w.acme_adapter.pk}/delete/", "/usage/", "/usage/?window=7d", "/audit/",
             "/audit/?status=error", "/capacity/", "/keys/", f"/keys/{w.acme_key.pk}/revoke/", "/members/",
             "/invitations/", "/operator/workers/", "/api/docs/", "/admin/"]
    for url in pages:
        visit(watched, url)
    assert watched.locator("svg rect").count() == 0  # (the admin) ...
    watched.goto("/usage/")
    assert watched.locator("svg rect").count() > 10  # ...the usage charts drew under the policy
    visit(watched, "/adapters/999999/", expect_status=404)

    watched.context.clear_cookies()
    log_in(watched, "bob", "bob-password-1")  # a viewer, and an invitee
    for url in ["/adapters/", "/invitations/", f"/adapters/{w.acme_adapter.pk}/upload/"]:
        visit(watched, url, expect_status=403 if url.endswith("upload/") else 200)


def test_the_pages_scripts_still_work_under_the_policy(transactional_db, watched, busy_world):
    """app.js's delegated handlers: the tenant switcher submits on change, a data-confirm form asks first, the
    copy button copies — with no violation on the way."""
    log_in(watched, "alice", "alice-password-1")
    watched.goto("/members/")
    assert watched.locator("#tenant-switch").count() == 1
    with watched.expect_navigation():
        watched.select_option("#tenant-switch", label="Globex")
    assert watched.locator(".tenant-name, #tenant-switch option[selected]").first.inner_text().strip() == "Globex"
    watched.select_option("#tenant-switch", label="Acme")
    watched.wait_for_url("**/members/")

    asked: list[str] = []

    def dismiss(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    watched.once("dialog", dismiss)  # removing bob asks first; dismissed, nothing is posted
    watched.locator('form[data-confirm^="Remove bob"] button[type=submit]').click()
    watched.wait_for_timeout(300)
    assert asked and asked[0].startswith("Remove bob from Acme?"), asked
    assert watched.url.endswith("/members/") and "bob" in watched.locator("main").inner_text()

    watched.goto("/keys/")
    watched.fill("input[name=name]", "csp-check")
    watched.get_by_role("button", name="Create key").click()
    secret = watched.locator("#new-secret").inner_text().strip()
    watched.context.grant_permissions(["clipboard-read", "clipboard-write"])
    watched.get_by_role("button", name="Copy").click()
    watched.get_by_role("button", name="Copied").wait_for()
    assert watched.evaluate("navigator.clipboard.readText()") == secret
    assert watched.problems() == []


def test_the_check_catches_what_the_policy_refuses(transactional_db, watched, world):
    """A control: injected inline code is refused by the browser and reported, so a clean page means clean."""
    visit(watched, "/login/")
    watched.evaluate("""() => {
        const s = document.createElement("script");
        s.textContent = "window.__ran = true";
        document.body.appendChild(s);
        const d = document.createElement("div");
        d.setAttribute("style", "color: red");
        document.body.appendChild(d);
    }""")
    watched.wait_for_timeout(300)
    assert watched.evaluate("window.__ran === undefined")  # the inline script never ran
    found = watched.problems()
    assert any(line.startswith("script-src") for line in found), found
    assert any(line.startswith("style-src") for line in found), found
