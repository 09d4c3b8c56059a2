"""One request's structured-output state, as the scheduler sees it: no torch, no xgrammar here.

The grammar is compiled on the manager's thread pool; the request waits in WAITING_FOR_FSM until
`is_ready()`. Then the scheduler admits it, or fails it with `error()` (e.g. an invalid schema).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Optional

from vlite.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams, future: Future,
                 make_matcher: Callable[[Any], Any]) -> None:
        self.params = params
        self._future = future
        self._make_matcher = make_matcher
        self._matcher: Any = None

    def is_ready(self) -> bool:
        """The compilation finished (successfully or not)."""
        return self._future.done()

    def error(self) -> Optional[str]:
        """Why the grammar could not be compiled; None when it compiled (call once is_ready())."""
        exc = self._future.exception()
        return None if exc is None else str(exc)

    @property
    def matcher(self) -> Any:
        """The request's own matcher over the shared compiled grammar, made on first use."""
        if self._matcher is None:
            self._matcher = self._make_matcher(self._future.result())
        return self._matcher

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher over the tokens the request kept; False if the grammar rejects one."""
        matcher = self.matcher
        for token_id in token_ids:
            if matcher.is_terminated():
                return True
            if not matcher.accept_token(token_id):
                logger.error("request %s: token %d rejected by its grammar", request_id, token_id)
                return False
        return True

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of draft tokens the grammar accepts; the matcher is left as it was."""
        matcher = self.matcher
        n = 0
        for token_id in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return token_ids[:n]

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def free(self) -> None:
        """The request ended: cancel a compilation not yet started (shared ones keep running), drop the matcher."""
        self._matcher = None
