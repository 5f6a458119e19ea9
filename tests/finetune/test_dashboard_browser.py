"""The fine-tuning page in a real browser (Debian's chromium, as tests/dashboard/test_browser.py): upload a dataset
and watch the progress bar reach 100%, start a job with the defaults, watch the job page go live while a trainer
runs it (status, loss line, link to the new version), cancel another job — with no Content-Security-Policy
violation on any of these pages."""
from __future__ import annotations

import threading

import pytest

from tests.dashboard.test_browser import browser, log_in, page, shot  # noqa: F401 (fixtures: one chromium recipe)
from tests.dashboard.test_csp import watched  # noqa: F401
from tests.finetune.helpers import GOOD_EXAMPLES, jsonl

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

WATCH_PROGRESS = """() => {
  window.__progress = [];
  const el = document.querySelector('#dataset-percent');
  new MutationObserver(() => window.__progress.push(el.textContent))
    .observe(el, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture
def ft_world(world, settings, tmp_path, ft_base_dir, monkeypatch):
    from adapters.services import register_base_model

    settings.STORAGES = {**settings.STORAGES, "adapters": {"BACKEND": "adapters.storage.AtomicFileSystemStorage",
                                                           "OPTIONS": {"location": str(tmp_path / "storage")}}}
    monkeypatch.setattr("finetune.jobs.publish_training_job", lambda job_id, base: None)
    register_base_model("tiny-ft", ft_base_dir, display_name="Tiny FT", max_lora_rank=16)
    return world


def test_upload_start_watch_and_cancel_with_no_csp_violation(transactional_db, watched, ft_world, tmp_path):  # noqa: F811
    from finetune.models import FineTuningJob, TrainingFile
    from finetune.trainer import run_job

    tab = watched
    dataset = tmp_path / "helper.jsonl"
    dataset.write_bytes(jsonl(GOOD_EXAMPLES * 40))  # 480 examples: big enough for progress events
    log_in(tab, "alice", "alice-password-1")
    tab.click("nav.mainnav >> text=Fine-tuning")
    tab.wait_for_url("**/fine-tuning/")
    assert tab.locator("#no-jobs").is_visible()

    # a bad file first: refused with its line, nothing stored
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    tab.set_input_files("#id_file", str(bad))
    tab.click("#dataset-button")
    tab.locator("#dataset-error").wait_for(state="visible")
    assert "line 1" in tab.locator("#dataset-error").inner_text()
    assert not TrainingFile.objects.exists()

    tab.evaluate(WATCH_PROGRESS)
    tab.set_input_files("#id_file", str(dataset))
    tab.click("#dataset-button")
    result = tab.locator("#dataset-result")
    result.wait_for(state="visible")
    stored = TrainingFile.objects.get()
    assert result.get_attribute("data-file") == stored.public_id and "480 examples" in result.inner_text()
    assert tab.eval_on_selector("#dataset-progress", "el => el.value") == 100
    seen = tab.evaluate("window.__progress")
    assert seen and seen[-1] == "100%"
    shot(tab, "ft-01-dataset-uploaded")

    tab.click("#dataset-continue")
    tab.select_option("#id_training_file", stored.public_id)
    tab.fill("#id_suffix", "helper")
    tab.fill("#id_seed", "3")
    tab.click("#job-button")
    tab.wait_for_url("**/fine-tuning/jobs/ftjob-*/")
    job = FineTuningJob.objects.get()
    assert tab.locator("#job-status").get_attribute("data-status") == "queued"
    assert tab.locator("#loss-chart").is_visible()

    # a trainer takes it while the page is open: the page follows without a reload
    trainer = threading.Thread(target=run_job, args=(job.public_id,), kwargs={"owner": "browser-test-trainer"})
    trainer.start()
    tab.locator('#job-status[data-status="succeeded"]').wait_for(timeout=120_000)
    trainer.join()
    job.refresh_from_db()
    assert tab.locator("#loss-chart polyline.line-a").count() == 1
    assert len(tab.locator("#loss-chart polyline.line-a").get_attribute("points").split()) == \
        job.result_version.provenance.steps
    assert job.fine_tuned_model in tab.locator("#job-result").inner_text()
    assert tab.locator("#cancel-form").is_hidden()
    shot(tab, "ft-02-job-succeeded")
    tab.click("#result-link")
    tab.wait_for_url(f"**/adapters/{job.result_version.adapter_id}/")

    # another job, cancelled from its page (the confirmation is accepted)
    tab.goto("/fine-tuning/")
    tab.select_option("#id_training_file", stored.public_id)
    tab.fill("#id_suffix", "helper")
    tab.click("#job-button")
    tab.wait_for_url("**/fine-tuning/jobs/ftjob-*/")
    tab.once("dialog", lambda dialog: dialog.accept())
    tab.click("#cancel-button")
    tab.locator('#job-status[data-status="cancelled"]').wait_for()
    assert FineTuningJob.objects.exclude(pk=job.pk).get().status == "cancelled"
    shot(tab, "ft-03-job-cancelled")
    assert tab.problems() == []
