"""Fault isolation: which request made a step raise, found by running suspects alone.

A step that raised with several requests in it cannot say whose input did it: every running request goes
back to `waiting` (recompute), and the step's requests run one at a time (`suspects`, head first) until each
has sampled a token alone or failed alone. The scheduler mixes this in; it uses its queues and `_schedule`.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from vlite.core.sched.output import SchedulerOutput
from vlite.core.sched.request_queue import create_request_queue, SchedulingPolicy
from vlite.request import Request, RequestStatus

if TYPE_CHECKING:
    from vlite.core.sched.scheduler import Scheduler


class FaultIsolation:
    """The scheduler's part that isolates a failing request (methods of `Scheduler`)."""

    def _schedule_isolated(self: Scheduler, suspect: Request) -> SchedulerOutput:
        """Schedule the head suspect alone: the normal schedule over queues holding only it.

        A suspect cleared in an earlier step goes back to `waiting` first (its blocks stay in
        the prefix cache) and is reported as preempted so the runner drops its row. Requests that
        arrive meanwhile queue as usual and start when isolation ends.
        """
        cleared = [r for r in self.running if r is not suspect]
        if cleared:
            self.running = [r for r in self.running if r is suspect]
            self._requeue(cleared)
        saved = self.waiting, self.skipped_waiting
        self.waiting, self.skipped_waiting = create_request_queue(self.policy), create_request_queue(self.policy)
        if suspect.status != RequestStatus.RUNNING:
            for queue in saved:
                if suspect in queue:
                    queue.remove_request(suspect)
                    break
            self.waiting.add_request(suspect)
        try:
            output = self._schedule()
        finally:
            if suspect.status != RequestStatus.RUNNING and not suspect.is_finished:
                saved[0].prepend_request(suspect)  # could not start (e.g. no free blocks yet)
            self.waiting, self.skipped_waiting = saved
        output.preempted_req_ids |= {r.request_id for r in cleared}
        return output

    def _requeue(self: Scheduler, requests: list[Request]) -> None:
        """Back to `waiting` without their blocks, not counted as preemptions (fault recovery).

        FCFS keeps `waiting` in arrival order; the priority heap orders them itself.
        """
        for request in requests:
            self._release_for_recompute(request)
        if self.policy == SchedulingPolicy.FCFS:
            merged = sorted([*self.waiting, *requests], key=lambda r: r.arrival_time)
            self.waiting = create_request_queue(self.policy)
            for request in merged:
                self.waiting.add_request(request)
        else:
            for request in requests:
                self.waiting.add_request(request)

    def handle_step_failure(self: Scheduler, scheduler_output: SchedulerOutput) -> list[Request]:
        """The step for `scheduler_output` raised after scheduling. Returns the requests failed.

        A request that was alone in the step is the cause: it finishes with FINISHED_ERROR. With
        several, the culprit is unknown: they become suspects and run alone, one at a time. The
        runner's batch state is discarded, so every running request returns to `waiting` and
        resumes with the tokens it has.
        """
        scheduled = [r for r in scheduler_output.num_scheduled_tokens if r in self.requests]
        failed: list[Request] = []
        if len(scheduled) == 1:
            failed = self.finish_requests(scheduled, RequestStatus.FINISHED_ERROR)
        self._requeue(self.running)
        self.running = []
        # Blocks hashed when allocated for this step may never have received their K/V. Requests loading from
        # a KV connector keep their blocks until the load is reported, then recompute (their prefix may be those).
        loading = self._discard_remote_kv_prefixes()
        reset = self.kv_cache_manager.reset_prefix_cache(force=loading)
        assert reset, "every block is free once nothing runs"
        if len(scheduled) > 1:
            known = set(scheduled)
            self.suspects = deque(scheduled + [r for r in self.suspects if r not in known])
        return failed

    def on_step_succeeded(self: Scheduler, scheduler_output: SchedulerOutput) -> None:
        """In isolation, a suspect that sampled alone without raising is cleared."""
        if self.suspects and (self.suspects[0] not in self.requests
                              or self.suspects[0] in scheduler_output.sample_req_ids):
            self.suspects.popleft()
