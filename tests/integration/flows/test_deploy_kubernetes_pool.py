"""`forgeflow deploy --pool-type kubernetes` creates a kubernetes work pool whose base job
template the Prefect server accepts (placeholders all declared) and keeps on re-deploy."""

from __future__ import annotations

import pytest

from flows.deploy import ensure_work_pool


def test_kubernetes_pool_with_forgeflow_base_job_template(prefect_api):
    from prefect import get_client

    ensure_work_pool("forgeflow-k8s", "kubernetes")
    ensure_work_pool("forgeflow-k8s", "kubernetes")  # idempotent
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("forgeflow-k8s")
    assert pool.type == "kubernetes"
    manifest = pool.base_job_template["job_configuration"]["job_manifest"]
    assert manifest["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert pool.base_job_template["variables"]["properties"]["image"]["default"]
    with pytest.raises(RuntimeError, match="exists with type 'kubernetes'"):
        ensure_work_pool("forgeflow-k8s", "process")
