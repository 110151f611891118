"""The Prefect UI page of a flow run, for an alert's link."""

from __future__ import annotations

from infra.notify import flow_run_url

RUN = "0b1e2f3a-0000-4000-8000-000000000001"


def test_the_ui_url_wins_then_the_api_url_less_api():
    assert flow_run_url(RUN, {"PREFECT_UI_URL": "https://prefect.lab/", "PREFECT_API_URL": "http://x:4200/api"}) \
        == f"https://prefect.lab/runs/flow-run/{RUN}"
    assert flow_run_url(RUN, {"PREFECT_API_URL": "http://prefect.lab:4200/api/"}) \
        == f"http://prefect.lab:4200/runs/flow-run/{RUN}"


def test_no_link_without_a_run_or_a_ui_to_point_at():
    assert flow_run_url(None, {"PREFECT_UI_URL": "https://prefect.lab"}) is None
    assert flow_run_url(RUN, {}) is None  # the ephemeral API: no UI
    # Prefect Cloud's API URL is not its UI's: without PREFECT_UI_URL no link is better than a wrong one
    assert flow_run_url(RUN, {"PREFECT_API_URL": "https://api.prefect.cloud/api/accounts/a/workspaces/w"}) is None
