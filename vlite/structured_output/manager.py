"""StructuredOutputManager: compiles grammars off the step loop and fills each step's bitmasks.

    EngineCore.add_request -> grammar_init(request): a future on the compile pool; the request waits
        in WAITING_FOR_FSM (the scheduler passes it over until the future is done)
    EngineCore.step -> grammar_bitmask(...): one bitmask row per constrained request sampled this
        step, filled from its matcher; the model runner applies them to the logits before sampling
    Scheduler.update_from_output -> StructuredOutputRequest.accept_tokens: the matcher advances

Compiled grammars are cached by their spec (kind, text, whitespace option); requests with the same
spec (n > 1 children, repeated schemas) share one compilation, each with its own matcher.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from vlite.sampling_params import StructuredOutputsParams
from vlite.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch

    from vlite.request import Request
    from vlite.structured_output.backend_xgrammar import XgrammarBackend

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 512


def _lowest_priority() -> None:
    """Compile threads run at the lowest CPU priority (nice 19, `VLITE_GRAMMAR_NICE` to change it; Linux
    sets it per thread, and threads they start inherit it). xgrammar compiles without the GIL, but at
    equal priority a compile thread takes a core from torch's threads and a forward waits at its
    barriers: on 2 cores, 8 decoding requests' steps went from 11 to 22 ms (one to 370 ms) while a 0.7 s
    schema compiled; at nice 19 their steps stay as without the compile, which uses what the step loop
    leaves (a large schema then waits while the engine keeps every core busy; nice 5 compiled it in
    3 s with steps ~25% slower meanwhile)."""
    try:
        nice = int(os.environ.get("VLITE_GRAMMAR_NICE", "19"))
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError, ValueError):  # not Linux, or not permitted: compile at normal priority
        pass


def _thinking(request: Request) -> bool:
    return request.reasoning is not None and request.reasoning.in_reasoning


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in a row of an int32 bitmask (bit j of word w is token 32 * w + j)."""
    bit = token_id % 32
    bitmask[row, token_id // 32] |= (1 << bit) if bit < 31 else -(1 << 31)


class GrammarOutput:
    """The step's bitmasks: row i constrains the sampled request req_ids[i]. A request verifying draft
    tokens (speculative decoding) has one row per position, in order: its req_id repeats."""

    def __init__(self, req_ids: list[str], bitmask: torch.Tensor) -> None:
        self.req_ids = req_ids
        self.bitmask = bitmask


class StructuredOutputManager:
    def __init__(self, tokenizer_loader: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int],
                 max_workers: Optional[int] = None) -> None:
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vlite-grammar",
                                            initializer=_lowest_priority)
        self._max_threads = workers
        self._backend: Optional[XgrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: set[Future] = set()

    # ---- compile -------------------------------------------------------------------------------

    def _get_backend(self) -> XgrammarBackend:
        """Built on first use, on a compile thread (loading the tokenizer takes ~1 s)."""
        with self._backend_lock:
            if self._backend is None:
                from vlite.structured_output.backend_xgrammar import XgrammarBackend

                tokenizer = self._tokenizer_loader()
                stop = set(self.eos_token_ids)
                if getattr(tokenizer, "eos_token_id", None) is not None:
                    stop.add(tokenizer.eos_token_id)
                self._backend = XgrammarBackend(tokenizer, self.vocab_size, sorted(stop), self._max_threads)
            return self._backend

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self._get_backend().compile(params)

    def grammar_init(self, request: Request) -> None:
        """Start (or share) the compilation of the request's grammar; the request waits for it."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.key()
        future = self._cache.get(key)
        if future is None or future.cancelled():
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.structured_output_request = StructuredOutputRequest(params, future, self._new_matcher)

    def _new_matcher(self, compiled: Any) -> Any:
        assert self._backend is not None
        return self._backend.new_matcher(compiled)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_for_compilation(self, timeout: float) -> None:
        """Block up to `timeout` s for a compilation to finish (when nothing else can run)."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    # ---- per step ------------------------------------------------------------------------------

    def grammar_bitmask(self, requests: dict[str, Request], sample_req_ids: set[str],
                        spec_tokens: Optional[dict[str, list[int]]] = None) -> Optional[GrammarOutput]:
        """Bitmasks of the constrained requests that sample this step (None when there are none).

        With draft tokens, the row of position i is the grammar's state after the first i drafts (the
        matcher advances over them, then rolls back): every position is masked as if they were kept.
        """
        # A reasoning model's grammar waits for the end of its thinking block (its answer is constrained).
        constrained = [(req_id, requests[req_id].structured_output_request) for req_id in sample_req_ids
                       if req_id in requests and requests[req_id].structured_output_request is not None
                       and not _thinking(requests[req_id])]
        if not constrained:
            return None
        backend = self._backend
        assert backend is not None
        spec_tokens = spec_tokens or {}
        row_req_ids = [req_id for req_id, _ in constrained for _ in range(1 + len(spec_tokens.get(req_id, ())))]
        bitmask = backend.allocate_bitmask(len(row_req_ids))
        row = 0
        for req_id, so_request in constrained:
            matcher = so_request.matcher
            backend.fill_bitmask(matcher, bitmask, row)
            opener = requests[req_id].reasoning.pending_token() if requests[req_id].reasoning is not None else None
            if opener is not None:  # the output may still open a thinking block instead of answering
                allow_token(bitmask, row, opener)
            drafts = spec_tokens.get(req_id, ())
            advanced = 0
            for token_id in drafts:  # drafts are a prefix the grammar accepts (see valid_prefix)
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    break  # past the grammar's end: the rows left stay all allowed (their tokens are cut off)
                advanced += 1
                if not matcher.is_terminated():
                    backend.fill_bitmask(matcher, bitmask, row + advanced)
            if advanced:
                matcher.rollback(advanced)
            row += 1 + len(drafts)
        return GrammarOutput(row_req_ids, bitmask)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
