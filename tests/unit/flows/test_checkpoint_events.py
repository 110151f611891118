"""The pretrain flow's checkpoint-committed announcements (the evaluate deployment's trigger)."""

from __future__ import annotations

from types import SimpleNamespace

from tasks import checkpoint_events


def test_announces_each_new_commit_once_and_not_the_ones_before_it_started(monkeypatch):
    committed = [(10, "s3://b/job/step-10")]  # from an earlier run of the job
    emitted = []
    monkeypatch.setattr(checkpoint_events, "committed_checkpoints", lambda spec: list(committed))
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed",
                        lambda url, job, step, path: emitted.append((step, url, job, path)))
    announcer = checkpoint_events.CommitAnnouncer(SimpleNamespace(name="job"), "job.yaml", every_s=3600)

    assert announcer.poll(force=True) == [] and emitted == []
    committed += [(20, "s3://b/job/step-20"), (30, "s3://b/job/step-30")]
    assert announcer.poll() == []  # throttled: storage is listed at most every `every_s`
    assert announcer.poll(force=True) == [20, 30]
    assert announcer.poll(force=True) == []
    assert emitted == [(20, "s3://b/job/step-20", "job", "job.yaml"), (30, "s3://b/job/step-30", "job", "job.yaml")]


def test_a_storage_error_is_retried_on_the_next_poll(monkeypatch):
    calls = {"n": 0}

    def listing(spec):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("S3 down")
        return [(10, "u10")] if calls["n"] >= 3 else []

    emitted = []
    monkeypatch.setattr(checkpoint_events, "committed_checkpoints", listing)
    monkeypatch.setattr(checkpoint_events, "emit_checkpoint_committed", lambda url, *a: emitted.append(url))
    announcer = checkpoint_events.CommitAnnouncer(SimpleNamespace(name="job"), "job.yaml")
    assert announcer.poll(force=True) == []  # the outage costs nothing
    assert announcer.poll(force=True) == [10] and emitted == ["u10"]
