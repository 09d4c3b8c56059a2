"""The model runner's pooling step: which rows of a step's hidden states a pooling request's output comes from.

A pooling request samples nothing: when the step that completes its prompt has run, the pooler turns its rows
of the hidden states into its output (vLLM's "pooling finished" stop), which the scheduler sends out as it
finishes the request. Its prompt ends in this step; how much of it the step computed depends on the pooling:
LAST pooling needs only the final token (the prompt may have been chunked, its prefix served from the cache),
the others need the whole prompt in the step (the engine then chunks nothing and caches no prefix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from vlite.core.sched.output import SchedulerOutput
    from vlite.worker.model_runner import CachedRequestState, StepInputs


def pooled_outputs(pooler: Any, hidden: torch.Tensor, inputs: StepInputs, scheduler_output: SchedulerOutput,
                   requests: dict[str, CachedRequestState]) -> dict[str, list[float]]:
    """req_id -> the pooled output of each pooling request whose prompt this step completed."""
    done = scheduler_output.prompt_done_req_ids
    if not done:
        return {}
    idx = np.fromiter((i for i, r in enumerate(inputs.req_ids) if r in done and requests[r].pooling_params
                       is not None), dtype=np.int64)
    if idx.size == 0:
        return {}
    req_ids = [inputs.req_ids[i] for i in idx]
    return dict(zip(req_ids, pooler.outputs(hidden, inputs.query_start_loc[idx], inputs.num_scheduled[idx],
                                            [requests[r].pooling_params for r in req_ids])))


def step_token_type_ids(inputs: StepInputs, num_computed: np.ndarray, requests: dict[str, CachedRequestState],
                        device: torch.device) -> Optional[torch.Tensor]:
    """[T] the token types of the step's tokens (cross-encoders' query 0 / document 1), None where no request of
    the step has any (all 0)."""
    states = [requests[r] for r in inputs.req_ids]
    if all(s.token_type_ids is None for s in states):
        return None
    parts = []
    for state, start, n in zip(states, num_computed.tolist(), inputs.num_scheduled.tolist()):
        types = state.token_type_ids
        parts.append(np.zeros(n, dtype=np.int64) if types is None else np.asarray(types[start:start + n]))
    return torch.from_numpy(np.concatenate(parts)).to(device)
