"""fetch-log is retried through a storage blip, not after a refusal or for a missing log."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from flows.diagnose import _retry_may_help, fetch_log


@pytest.mark.parametrize("error, retried", [
    (PermissionError("refusing to read /etc/passwd"), False),
    (FileNotFoundError("no log file at /x.log"), False),
    (ConnectionError("connection reset by the object store"), True),
    (TimeoutError("read timed out"), True),
])
def test_only_an_error_a_retry_may_clear_is_retried(error, retried):
    assert _retry_may_help(fetch_log, None, Failed(data=error)) is retried
    assert fetch_log.retries == 2 and fetch_log.retry_condition_fn is _retry_may_help
