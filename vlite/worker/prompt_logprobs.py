"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob given the tokens before
it, from the hidden states of the step's prompt chunks. Apart from the runner, which calls it per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlite.sample.sampler import gather_logprobs

if TYPE_CHECKING:
    from vlite.worker.input_batch import InputBatch
    from vlite.worker.model_runner import StepInputs


def compute_prompt_logprobs(hidden: torch.Tensor, inputs: StepInputs, batch: InputBatch, requests: dict[str, Any],
                            model: torch.nn.Module, vocab_size: int, device: torch.device) -> dict:
    """{req_id: (token ids, logprobs, ranks)} for the requests of the step that ask.

    The hidden state at position p predicts token p+1; a chunk covering positions
    [start, start+n) yields entries for prompt tokens start+1 .. min(start+n, num_prompt-1).
    Each request's CachedRequestState.num_prompt_logprobs_done records how far it got. `model.compute_logits`
    is looked up only for such a request (pooling models have none).
    """
    out: dict = {}
    for i, (req_id, row) in enumerate(zip(inputs.req_ids, inputs.rows)):
        params = batch.sampling_params[row]
        if params is None or params.prompt_logprobs is None:
            continue
        state = requests[req_id]
        start = int(batch.num_computed_tokens[row])
        n_prompt = int(batch.num_prompt_tokens[row])
        first = max(start, state.num_prompt_logprobs_done)  # position whose successor is scored
        end = min(start + int(inputs.num_scheduled[i]), n_prompt - 1)
        if end <= first:
            continue
        q0 = int(inputs.query_start_loc[i])
        logprobs = torch.log_softmax(model.compute_logits(hidden[q0 + first - start:q0 + end - start]), -1)
        targets = torch.from_numpy(batch.token_ids[row, first + 1:end + 1].copy()).to(device)
        k = params.prompt_logprobs if params.prompt_logprobs >= 0 else vocab_size
        lt = gather_logprobs(logprobs, min(k, vocab_size), targets)
        out[req_id] = (lt.token_ids.tolist(), lt.logprobs.tolist(), lt.ranks.tolist())
        state.num_prompt_logprobs_done = end
    return out
