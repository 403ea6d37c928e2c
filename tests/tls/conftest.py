"""The certificates fixture of the TLS tests (see ``support.tls``)."""

from __future__ import annotations

import pytest

from support.tls import Certificates, make_certificates


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """Certificates made once per session (trustme: a CA, server and client certificates)."""
    return make_certificates(tmp_path_factory.mktemp("tls"))
