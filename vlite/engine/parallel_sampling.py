"""Parallel sampling (n > 1): one user request fans out into n child requests.

The children share the prompt, so the prefix cache computes it once; their outputs are merged
back into one RequestOutput whose `outputs` carry index 0..n-1.
"""

from __future__ import annotations

from typing import Optional

from vlite.outputs import CompletionOutput, RequestOutput
from vlite.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self._latest: list[Optional[CompletionOutput]] = [None] * self.n
        self._finished: set[int] = set()

    def child_params(self, index: int) -> SamplingParams:
        """n=1 copies; a seeded request gives child i the seed + i so the samples differ."""
        params = self.params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return params

    def aggregate(self, index: int, child: RequestOutput) -> Optional[RequestOutput]:
        completion = child.outputs[0]
        completion.index = index
        if child.finished:
            self._finished.add(index)
        finished = len(self._finished) == self.n
        kind = self.params.output_kind
        if kind == RequestOutputKind.DELTA:
            outputs = [completion]
        else:
            self._latest[index] = completion
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                return None
            outputs = [c for c in self._latest if c is not None]
        return RequestOutput(request_id=self.request_id, prompt=child.prompt, prompt_token_ids=child.prompt_token_ids,
                             outputs=outputs, finished=finished, prompt_logprobs=child.prompt_logprobs,
                             num_cached_tokens=child.num_cached_tokens, metrics=child.metrics)
