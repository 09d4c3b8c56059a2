"""Waiting queues for the scheduler.

The scheduler only ever talks to the :class:`RequestQueue` interface
(``peek_request`` / ``pop_request`` / ``prepend_request`` ...), so the queueing
policy (FCFS or priority) is a pluggable detail chosen once by
:func:`create_request_queue`. Both ``waiting`` and ``skipped_waiting`` queues
are instances of the same type.

Membership (``remove_request``, ``remove_requests``, ``in``) is decided by
object *identity*, never ``==``: a request is a unique live object, and request
classes such as ``@dataclass`` types may define field-wise ``__eq__`` (and be
unhashable), which must not make two distinct requests look alike.
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Generic, Protocol, TypeVar, runtime_checkable

__all__ = [
    "SchedulingPolicy",
    "QueueableRequest",
    "RequestQueue",
    "FCFSRequestQueue",
    "PriorityRequestQueue",
    "create_request_queue",
]


class SchedulingPolicy(enum.Enum):
    """Order in which waiting requests are admitted."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, value: object) -> SchedulingPolicy:
        """`value` (a policy or its name, any case) as a policy; else an error naming the setting and the choices."""
        try:
            return cls(str(value.value if isinstance(value, cls) else value).strip().lower())
        except ValueError:
            raise ValueError(f"scheduling_policy must be one of {[p.value for p in cls]}, got {value!r}") from None


@runtime_checkable
class QueueableRequest(Protocol):
    """What a queue needs from a request (the real class is ``vlite.request.Request``).

    Read-only properties so that both plain attributes and properties satisfy it.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def arrival_time(self) -> float: ...


R = TypeVar("R", bound=QueueableRequest)


class RequestQueue(ABC, Generic[R]):
    """Abstract waiting queue: one entry point for "the next request to schedule"."""

    __slots__ = ()

    @abstractmethod
    def add_request(self, request: R) -> None:
        """Enqueue a newly arrived request at its policy position (FCFS: the tail)."""

    @abstractmethod
    def pop_request(self) -> R:
        """Remove and return the next request; ``IndexError`` if the queue is empty."""

    @abstractmethod
    def peek_request(self) -> R:
        """Return the next request without removing it; ``IndexError`` if empty."""

    @abstractmethod
    def prepend_request(self, request: R) -> None:
        """Put a request back so it is (re)considered first, e.g. after preemption."""

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue[R] | Iterable[R]) -> None:
        """Prepend many requests; see each implementation for the resulting order."""

    @abstractmethod
    def remove_request(self, request: R) -> None:
        """Remove one request (by identity); ``ValueError`` if it is not queued."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[R]) -> None:
        """Remove every queued request in ``requests`` (by identity) in O(n + m).

        Requests that are not queued are ignored. Any iterable works, including a
        generator or another (or the same) queue.
        """

    @abstractmethod
    def __bool__(self) -> bool:
        """True iff at least one request is queued."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of queued requests."""

    @abstractmethod
    def __iter__(self) -> Iterator[R]:
        """Iterate in pop order without modifying the queue."""

    def __contains__(self, request: object) -> bool:
        """Identity membership test (O(n))."""
        return any(r is request for r in self)

    def __repr__(self) -> str:
        ids = ", ".join(r.request_id for r in self)
        return f"{type(self).__name__}([{ids}])"


def _materialize(requests: Iterable[R]) -> list[R]:
    """Snapshot ``requests`` so callers may pass a generator or the queue itself."""
    return list(requests)


class FCFSRequestQueue(RequestQueue[R]):
    """First-come-first-served queue backed by a ``collections.deque``.

    Composition rather than subclassing ``deque``: it keeps the public surface
    to the ``RequestQueue`` contract (no stray ``deque.remove`` with ``==``
    semantics, no ``deque.__eq__``/unhashability leaking into the scheduler) while
    every operation is still a native O(1) deque call at the ends.
    """

    __slots__ = ("_queue",)

    def __init__(self, requests: Iterable[R] = ()) -> None:
        self._queue: deque[R] = deque(requests)

    def add_request(self, request: R) -> None:
        """Append at the tail."""
        self._queue.append(request)

    def pop_request(self) -> R:
        """Pop from the head."""
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def peek_request(self) -> R:
        """Head of the queue."""
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def prepend_request(self, request: R) -> None:
        """Put ``request`` at the head, so it is popped next."""
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue[R] | Iterable[R]) -> None:
        """Prepend like ``deque.extendleft``: the given order ends up REVERSED.

        ``[x].prepend_requests([a, b, c])`` gives ``[c, b, a, x]``: each element is
        pushed to the head in turn. This is intended: a queue filled with
        ``prepend_request`` (itself reversed) is restored to its original order
        by prepending it here.
        """
        self._queue.extendleft(_materialize(requests))

    def remove_request(self, request: R) -> None:
        """Remove the first occurrence of ``request`` (by identity), O(n)."""
        for i, r in enumerate(self._queue):
            if r is request:
                del self._queue[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[R]) -> None:
        """Rebuild without the given requests: one pass with an id set, O(n + m)."""
        ids = {id(r) for r in _materialize(requests)}
        if ids:
            self._queue = deque(r for r in self._queue if id(r) not in ids)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[R]:
        return iter(self._queue)


# Heap entry: (priority, arrival_time, insertion counter, request). The counter is
# unique, so tuple comparison never reaches the request object itself.
_HeapEntry = tuple[int, float, int, R]


class PriorityRequestQueue(RequestQueue[R]):
    """Priority queue on ``heapq``: lower ``priority`` first, then earlier arrival.

    Ties on both keys pop in insertion order (a monotonically increasing counter
    is the third heap key), so ordering is deterministic and requests need no
    ``__lt__``. ``priority``/``arrival_time`` are read once, on insertion; mutate
    them only after removing the request and re-add it afterwards.
    """

    __slots__ = ("_heap", "_counter")

    def __init__(self, requests: Iterable[R] = ()) -> None:
        self._heap: list[_HeapEntry[R]] = []
        self._counter = 0
        for request in requests:
            self.add_request(request)

    def _entry(self, request: R) -> _HeapEntry[R]:
        self._counter += 1
        return (request.priority, request.arrival_time, self._counter, request)

    def add_request(self, request: R) -> None:
        """Push by (priority, arrival_time, insertion order), O(log n)."""
        heapq.heappush(self._heap, self._entry(request))

    def pop_request(self) -> R:
        """Pop the smallest (priority, arrival_time), O(log n)."""
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> R:
        """Smallest (priority, arrival_time) without removing it."""
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][-1]

    def prepend_request(self, request: R) -> None:
        """Same as ``add_request``: a heap has no head to jump to.

        A preempted request regains its place through its own (priority,
        arrival_time), which is usually earlier than anything that arrived since.
        """
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue[R] | Iterable[R]) -> None:
        """``add_request`` each one; the given order only matters for exact ties."""
        for request in _materialize(requests):
            self.add_request(request)

    def remove_request(self, request: R) -> None:
        """Remove ``request`` (by identity), O(n) scan + heapify."""
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[R]) -> None:
        """Filter with an id set and heapify once, O(n + m)."""
        ids = {id(r) for r in _materialize(requests)}
        if ids:
            self._heap = [e for e in self._heap if id(e[-1]) not in ids]
            heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[R]:
        """Pop order over a sorted snapshot; the heap itself is untouched."""
        return iter([entry[-1] for entry in sorted(self._heap)])


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """Build the queue for ``policy`` (enum or its value, case-insensitive)."""
    if not isinstance(policy, SchedulingPolicy):
        valid = [p.value for p in SchedulingPolicy]
        try:
            policy = SchedulingPolicy(str(policy).strip().lower())
        except ValueError:
            raise ValueError(
                f"unknown scheduling policy {policy!r}; expected one of {valid}"
            ) from None
    if policy is SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(f"unsupported scheduling policy {policy!r}")  # new enum member
