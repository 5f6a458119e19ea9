from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in, user_login_failed

        from . import login_limits

        # failed logins count towards a lockout, a successful one clears the count (gateway/login_limits.py)
        user_login_failed.connect(login_limits.record_failure, dispatch_uid="lorafleet_login_failed")
        user_logged_in.connect(login_limits.clear_failures, dispatch_uid="lorafleet_login_cleared")
