"""The Django app config of the outbox."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):  # type: ignore[misc]  # Django is untyped here
    """``reliable_amqp.outbox.django``: the outbox tables' migration and ``outbox_relay``."""

    name = "reliable_amqp.outbox.django"
    label = "reliable_amqp_outbox"
    verbose_name = "AMQP outbox"
    default_auto_field = "django.db.models.BigAutoField"
