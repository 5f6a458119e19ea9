"""The upload view stops reading a body at the size cap, before CSRF or form parsing reads it all."""
import pytest
from django.urls import reverse

from adapters.models import AdapterVersion


@pytest.fixture
def as_alice(client, world):
    client.force_login(world.alice)
    return client


def test_an_upload_over_the_cap_is_cut_off_with_413_and_stores_nothing(
    as_alice, real_base, dash_files, upload_files, adapter_storage_dir, settings
):
    files = upload_files(dash_files.good1)
    settings.LORAFLEET_MAX_UPLOAD_BYTES = files["weights_file"].size // 2
    response = as_alice.post(
        reverse("adapters:upload", args=[real_base.writer.pk]), files, HTTP_ACCEPT="application/json"
    )
    assert response.status_code == 413, response.content
    assert "upload limit" in response.json()["error"]
    assert not AdapterVersion.objects.filter(adapter=real_base.writer).exists()
    assert not any(p.is_file() for p in adapter_storage_dir.rglob("*"))


def test_the_cut_off_upload_still_checks_csrf(real_base, dash_files, upload_files, world):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(world.alice)
    response = client.post(
        reverse("adapters:upload", args=[real_base.writer.pk]), upload_files(dash_files.good1),
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 403
    assert not AdapterVersion.objects.filter(adapter=real_base.writer).exists()
