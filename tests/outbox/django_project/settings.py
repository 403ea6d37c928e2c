"""Settings of the outbox tests' Django project: the database comes from the environment
(``OUTBOX_DJANGO_DB``: a ``postgresql://`` URL or a SQLite file path), so each test runs it
against a database of its own."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

SECRET_KEY = "outbox-tests"
USE_TZ = True
INSTALLED_APPS = ["reliable_amqp.outbox.django"]
RELIABLE_AMQP_URL = os.environ["AMQP_URL"]  # the test broker, set by tests/outbox/test_stacks.py

_db = os.environ["OUTBOX_DJANGO_DB"]
if _db.startswith("postgresql://"):
    _url = urlsplit(_db)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _url.path.lstrip("/"),
            "USER": _url.username or "",
            "PASSWORD": _url.password or "",
            "HOST": _url.hostname or "",
            "PORT": str(_url.port or ""),
        }
    }
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": _db}}
