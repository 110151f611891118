"""A straggler found while training runs becomes an artifact and a Slack alert naming its
node and rank (tasks.pretrain_tasks.report_straggler, called by run_attempt's watcher)."""

from __future__ import annotations


def test_a_straggler_is_alerted_and_kept_as_an_artifact(prefect_api, slack):
    from prefect.client.orchestration import get_client

    from infra.watch import Straggler
    from tasks.pretrain_tasks import report_straggler

    found = Straggler(rank=3, node="gpu-node-2", host="gpu-node-2.cluster", step=140,
                      compute_s=0.9, others_median_s=0.3, samples=3)
    report_straggler("tiny-cpu", 1, found)
    text = "\n".join(slack.texts())
    assert "straggler" in text and "rank 3 on gpu-node-2" in text and "3.0x" in text

    async def artifact_keys() -> list[str]:
        async with get_client() as client:
            return [a.key for a in await client.read_artifacts()]

    import asyncio

    assert "straggler-tiny-cpu-1-rank3" in asyncio.run(artifact_keys())
