"""lorafleet's Django project (cookiecutter-django's name; see README for why it is not `platform`)."""
from .celery_app import app as celery_app

__all__ = ["celery_app"]
