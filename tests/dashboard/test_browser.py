"""The dashboard in a real browser: Playwright driving Debian's chromium against a live server.

Flows a customer goes through: log in, upload a PEFT adapter and watch the progress bar reach 100%,
see the validation error for a bad one, drag files in, make an older version live and see the badge
move, create a key and see its secret once, revoke it. Every page is saved under var/screenshots/.
"""
from __future__ import annotations

import base64
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """One chromium for this module, closed after it: Playwright's sync API keeps an asyncio loop
    running in this thread while it is open, and Django refuses ORM calls (here, and in the database
    flush between transactional tests) under a running loop unless DJANGO_ALLOW_ASYNC_UNSAFE is set.
    Both are scoped to this module so no other test runs under them."""
    if not CHROMIUM.exists():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium).")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser, live_server):
    context = browser.new_context(viewport={"width": 1366, "height": 860}, base_url=live_server.url)
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.set_default_timeout(15_000)
    yield page
    context.close()


def shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def log_in(page, username: str, password: str) -> None:
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url("**/adapters/")


WATCH_PROGRESS = """() => {
  window.__progress = [];
  const el = document.querySelector('#upload-percent');
  new MutationObserver(() => window.__progress.push(el.textContent))
    .observe(el, {childList: true, characterData: true, subtree: true});
}"""


def test_upload_progress_validation_error_and_drag_and_drop(transactional_db, page, real_base, dash_files):
    from adapters.models import AdapterVersion

    page.goto("/login/")
    shot(page, "01-login")
    log_in(page, "alice", "alice-password-1")
    shot(page, "02-adapters-list")

    # a bad adapter first: the error appears next to the form, nothing is stored
    page.goto(f"/adapters/{real_base.writer.pk}/upload/")
    page.set_input_files("#id_config_file", str(dash_files.bad / "adapter_config.json"))
    page.set_input_files("#id_weights_file", str(dash_files.bad / "adapter_model.safetensors"))
    page.click("#upload-button")
    error = page.locator("#upload-error")
    error.wait_for(state="visible")
    assert "Upload refused" in error.inner_text() and "lora_A" in error.inner_text()
    assert "lora_A" in page.locator('[data-error-for="weights_file"]').inner_text()  # next to the weights input
    shot(page, "03-upload-validation-error")
    assert not AdapterVersion.objects.filter(adapter=real_base.writer).exists()

    # a good one: the progress bar reaches 100% and the new version's number and sha256 are shown
    page.goto(f"/adapters/{real_base.writer.pk}/upload/")
    page.evaluate(WATCH_PROGRESS)
    page.set_input_files("#id_config_file", str(dash_files.good1 / "adapter_config.json"))
    page.set_input_files("#id_weights_file", str(dash_files.good1 / "adapter_model.safetensors"))
    page.click("#upload-button")
    result = page.locator("#upload-result")
    result.wait_for(state="visible")
    version = AdapterVersion.objects.get(adapter=real_base.writer, number=1)
    assert "Version 1 stored and live" in result.inner_text()
    assert page.locator("#new-version-sha").inner_text() == version.sha256
    assert page.eval_on_selector("#upload-progress", "el => el.value") == 100
    seen = page.evaluate("window.__progress")
    assert seen and seen[-1] == "100%"
    assert [int(s.rstrip("%")) for s in seen] == sorted(int(s.rstrip("%")) for s in seen)
    shot(page, "04-upload-done")

    # drag both files of the second adapter onto the drop zone
    page.goto(f"/adapters/{real_base.writer.pk}/upload/")
    files = {name: base64.b64encode((dash_files.good2 / name).read_bytes()).decode()
             for name in ("adapter_config.json", "adapter_model.safetensors")}
    transfer = page.evaluate_handle("""(files) => {
        const dt = new DataTransfer();
        for (const [name, b64] of Object.entries(files)) {
            const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
            dt.items.add(new File([bytes], name));
        }
        return dt;
    }""", files)
    page.dispatch_event("#dropzone", "drop", {"dataTransfer": transfer})
    assert page.eval_on_selector("#id_weights_file", "el => el.files[0].name") == "adapter_model.safetensors"
    assert page.eval_on_selector("#id_config_file", "el => el.files[0].name") == "adapter_config.json"
    page.click("#upload-button")
    page.locator("#upload-result").wait_for(state="visible")
    assert "Version 2 stored." in page.locator("#upload-result").inner_text()
    assert AdapterVersion.objects.filter(adapter=real_base.writer).count() == 2
    page.goto("/adapters/")
    assert "v1" in page.locator("#adapters-table").inner_text()
    shot(page, "04b-adapters-list-after-upload")


def test_make_an_older_version_live_and_see_the_badge_move(transactional_db, page, world):
    log_in(page, "alice", "alice-password-1")
    page.goto(f"/adapters/{world.acme_adapter.pk}/")
    assert page.locator('tr[data-version="2"] .badge-live').count() == 1
    shot(page, "05-adapter-detail")
    page.locator('tr[data-version="1"]').get_by_role("link", name="Make live").click()
    assert page.locator("#pointer-move").inner_text().split() == ["v2", "→", "v1", "rollback"]
    page.fill("textarea[name=reason]", "v2 answers in the wrong language")
    shot(page, "06-make-live-confirm")
    page.get_by_role("button", name="Make v1 live").click()
    page.wait_for_url(f"**/adapters/{world.acme_adapter.pk}/")
    assert page.locator('tr[data-version="1"] .badge-live').count() == 1
    assert page.locator('tr[data-version="2"] .badge-live').count() == 0
    assert page.locator('tr[data-version="2"]').get_by_role("link", name="Make live").count() == 1
    assert "v2 answers in the wrong language" in page.locator("#history-table").inner_text()
    shot(page, "07-adapter-detail-after-rollback")
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v1


def test_create_a_key_see_the_secret_once_and_revoke_it(transactional_db, page, world):
    from gateway.keys import KeyRejected, authenticate_api_key

    log_in(page, "alice", "alice-password-1")
    page.goto("/keys/")
    page.fill("input[name=name]", "billing-service")
    page.select_option("select[name=bound_adapter]", label="support-bot")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-secret").inner_text().strip()
    assert secret.startswith("lf_live_") and "only time the full key is shown" in page.content()
    page.get_by_role("button", name="Copy").click()
    page.get_by_role("button", name="Copied").wait_for()  # the button confirms for 1.5 s
    assert page.evaluate("navigator.clipboard.readText()") == secret
    shot(page, "08-key-created")
    key = authenticate_api_key(secret)
    assert key.bound_adapter == world.acme_adapter

    page.goto("/keys/")
    assert secret not in page.content() and page.locator("#new-secret").count() == 0
    row = page.locator(f'tr[data-key="{key.prefix}"]')
    assert key.last4 in row.inner_text() and "support-bot" in row.inner_text()
    row.get_by_role("link", name="Revoke").click()
    shot(page, "09-key-revoke-confirm")
    page.get_by_role("button", name="Revoke key").click()
    page.wait_for_url("**/keys/")
    assert "revoked" in page.locator(f'tr[data-key="{key.prefix}"]').inner_text()
    shot(page, "10-keys-after-revoke")
    with pytest.raises(KeyRejected) as refused:
        authenticate_api_key(secret)
    assert refused.value.reason == "revoked"


def test_every_page_renders_for_a_viewer_and_an_owner(transactional_db, page, world):
    """Screenshots of the remaining pages, with traffic so the charts have bars; bob sees no write buttons."""
    from gateway.models import AuditRecord

    now = timezone.now()
    for i in range(60):
        AuditRecord.objects.create(
            route="/v1/chat/completions", tenant=world.acme, adapter=world.acme_adapter, adapter_name="support-bot",
            version_number=2, created_at=now - timedelta(minutes=23 * i), status="error" if i % 17 == 0 else "ok",
            prompt_tokens=20 + i, completion_tokens=10 + i % 7, total_seconds=0.05 + (i % 9) / 40,
            key_prefix=world.acme_key.prefix, weights_sha256="b" * 64,
        )
    log_in(page, "bob", "bob-password-1")
    page.goto(f"/adapters/{world.acme_adapter.pk}/")
    assert page.get_by_role("link", name="Make live").count() == 0
    assert page.get_by_role("link", name="Upload new version").count() == 0
    assert page.get_by_role("link", name="API keys").count() == 0
    for name, url in [("11-usage-24h", "/usage/"), ("12-usage-7d", "/usage/?window=7d"), ("13-audit", "/audit/"),
                      ("14-members", "/members/"), ("15-capacity", "/capacity/")]:
        page.goto(url)
        assert page.locator("h1").count() == 1
        shot(page, name)
    page.goto("/usage/")
    assert page.locator("svg rect").count() > 20
    page.goto("/audit/?status=error")
    assert page.locator("#audit-table tbody tr").count() == 4  # i = 0, 17, 34, 51
    page.goto(f"/adapters/{world.acme_adapter.pk}/upload/")
    assert "viewer" in page.content()  # a clear refusal, not a broken page
    shot(page, "16-viewer-refused-upload")

    page.context.clear_cookies()
    log_in(page, "alice", "alice-password-1")
    page.goto("/adapters/new/")
    shot(page, "17-new-adapter")
    page.goto(f"/adapters/{world.acme_adapter.pk}/upload/")
    shot(page, "18-upload-form")
