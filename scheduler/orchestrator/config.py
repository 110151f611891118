"""How the orchestrator behaves (policy, leases, lost jobs) and the errors it raises."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.cluster import ClusterError


class OrchestratorError(ClusterError):
    """A request the orchestrator refuses: unknown cluster, node or job, or an operation that does not apply."""


class LeaseLostError(OrchestratorError):
    """The job no longer holds its GPUs (its lease expired and they went back to the pool)."""


class OrchestratorConfig(BaseModel):
    """Scheduling policy and lease rules. Leases: a holder renews every `lease_s / 3`; GPUs whose
    lease is `grace_s` past its expiry go back to the pool and the job is lost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: the policy the cluster file chose (`policy:` in the inventory, stored by register);
    # elastic admits as FCFS (`scheduler.policy.ADMITS_AS`)
    policy: Literal["fcfs", "has", "ect", "easy", "elastic"] | None = None
    lease_s: float = Field(default=60.0, gt=0, description="how long one renewal holds the GPUs")
    grace_s: float = Field(default=30.0, ge=0, description="extra time before an expired lease is reclaimed")
    on_lost: Literal["requeue", "fail"] = "requeue"
    max_requeues: int = Field(default=3, ge=0, description="a job lost more often than this fails")
    reservation_depth: int = Field(default=8, ge=0, description="ECT: waiting jobs that reserve their slot")
    # (issue 31) the decider (`serve`) preempts for waiting jobs of a higher class or on their own
    # quota (`scheduler.preemption`), giving each victim this long to stop; None: no preemption
    preempt_stop_s: float | None = Field(default=None, gt=0, description="a preempted job's time to stop")
    # (issue 31 items 3-4) on a cluster with policy elastic the decider (`serve`) resizes running jobs
    # (`scheduler.elastic`, carried out like a preemption: `Orchestrator.resize`), giving each this long to stop
    resize_stop_s: float = Field(default=300.0, gt=0, description="a resized job's time to stop")
