"""Storage options print without their secrets (they reach logs, tracebacks, Prefect runs)."""

from __future__ import annotations

import logging

from infra.storage import StorageOptions


def test_repr_str_and_logs_hide_the_secret_key_and_session_token(caplog):
    options = StorageOptions(endpoint_url="http://127.0.0.1:9000", access_key="AKIAEXAMPLE",
                             secret_key="wJalrXUtnFEMI-very-secret", session_token="FwoGZXIvYXdzEXAMPLE")
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("options: %s / %r / %s", options, options, [options])
    for text in (repr(options), str(options), f"{options}", caplog.text):
        assert "wJalrXUtnFEMI-very-secret" not in text and "FwoGZXIvYXdzEXAMPLE" not in text
        assert "secret_key='***'" in text and "session_token='***'" in text
        assert "access_key='AKIAEXAMPLE'" in text and "http://127.0.0.1:9000" in text
    assert options.secret_key == "wJalrXUtnFEMI-very-secret"  # still there for the client
    assert options.to_dict()["secret_key"] == "wJalrXUtnFEMI-very-secret"
    assert "secret_key=None" in repr(StorageOptions())  # unset stays visibly unset
