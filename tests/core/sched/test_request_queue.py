"""Tests for vlite.core.sched.request_queue (FCFS and priority waiting queues)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlite.core.sched import request_queue as rq_module
from vlite.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    QueueableRequest,
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)

_ids = itertools.count()


class Req:
    """Minimal duck-typed request; default identity equality."""

    __slots__ = ("request_id", "priority", "arrival_time")

    def __init__(self, priority: int = 0, arrival_time: float = 0.0, rid: str | None = None):
        self.request_id = rid if rid is not None else f"r{next(_ids)}"
        self.priority = priority
        self.arrival_time = arrival_time

    def __repr__(self) -> str:
        return self.request_id


@dataclasses.dataclass
class DataReq:
    """dataclass request: field-wise __eq__ and unhashable (eq=True, no frozen)."""

    request_id: str
    priority: int = 0
    arrival_time: float = 0.0


class Hostile(Req):
    """A request that must never be compared or hashed by the queues."""

    __slots__ = ()

    def __lt__(self, other: Any) -> bool:
        raise AssertionError("requests must not be compared")

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(self, other: Any) -> bool:
        raise AssertionError("requests must not be ==-compared")

    def __hash__(self) -> int:
        raise AssertionError("requests must not be hashed")


QUEUES = [FCFSRequestQueue, PriorityRequestQueue]


def make(n: int) -> list[Req]:
    """n requests with equal priority and increasing arrival (same order in both queues)."""
    return [Req(0, float(i), f"r{i}") for i in range(n)]


def ids(q: Any) -> list[str]:
    return [r.request_id for r in q]


# ---------------------------------------------------------------- interface


def test_module_does_not_import_torch() -> None:
    tree = ast.parse(Path(rq_module.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert "torch" not in names
    assert "vlite" not in names  # no dependency on vlite.request


def test_abc_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        RequestQueue()  # type: ignore[abstract]

    class Partial(RequestQueue):
        def add_request(self, request: Any) -> None: ...

    with pytest.raises(TypeError):
        Partial()  # type: ignore[abstract]


def test_policy_enum_values() -> None:
    assert [p.value for p in SchedulingPolicy] == ["fcfs", "priority"]


def test_protocol_runtime_check() -> None:
    assert isinstance(Req(), QueueableRequest)
    assert isinstance(DataReq("x"), QueueableRequest)
    assert not isinstance(object(), QueueableRequest)


@pytest.mark.parametrize("cls", QUEUES)
def test_is_request_queue(cls: type) -> None:
    assert isinstance(cls(), RequestQueue)


# ---------------------------------------------------------------- common behaviour


@pytest.mark.parametrize("cls", QUEUES)
def test_empty_queue(cls: type) -> None:
    q = cls()
    assert len(q) == 0 and not q and list(q) == []
    with pytest.raises(IndexError, match="peek from an empty request queue"):
        q.peek_request()
    with pytest.raises(IndexError, match="pop from an empty request queue"):
        q.pop_request()


@pytest.mark.parametrize("cls", QUEUES)
def test_len_bool_add_pop(cls: type) -> None:
    q = cls()
    reqs = make(3)
    for i, r in enumerate(reqs, 1):
        q.add_request(r)
        assert len(q) == i and q
    assert [q.pop_request() for _ in range(3)] == reqs
    assert len(q) == 0 and not q
    with pytest.raises(IndexError):
        q.pop_request()


@pytest.mark.parametrize("cls", QUEUES)
def test_peek_does_not_remove(cls: type) -> None:
    q = cls()
    a, b = make(2)
    q.add_request(a)
    q.add_request(b)
    assert q.peek_request() is a
    assert q.peek_request() is a
    assert len(q) == 2
    assert q.pop_request() is a
    assert q.peek_request() is b


@pytest.mark.parametrize("cls", QUEUES)
def test_iteration_is_pop_order_and_non_destructive(cls: type) -> None:
    reqs = [Req(p, t) for p, t in [(2, 0.0), (0, 5.0), (1, 1.0), (0, 1.0), (2, 0.0)]]
    q = cls()
    for r in reqs:
        q.add_request(r)
    first = list(q)
    assert list(q) == first  # repeatable
    assert len(q) == len(reqs)
    assert [q.pop_request() for _ in range(len(reqs))] == first


@pytest.mark.parametrize("cls", QUEUES)
def test_remove_request(cls: type) -> None:
    q = cls()
    reqs = make(4)
    for r in reqs:
        q.add_request(r)
    q.remove_request(reqs[2])
    assert ids(q) == ["r0", "r1", "r3"]
    q.remove_request(reqs[0])  # the head
    assert q.peek_request() is reqs[1]
    q.remove_request(reqs[3])  # the tail
    assert ids(q) == ["r1"]
    q.remove_request(reqs[1])
    assert not q


@pytest.mark.parametrize("cls", QUEUES)
def test_remove_absent_raises_value_error(cls: type) -> None:
    q = cls()
    a, b = make(2)
    with pytest.raises(ValueError, match="r1"):
        q.remove_request(b)
    q.add_request(a)
    with pytest.raises(ValueError):
        q.remove_request(b)
    assert ids(q) == ["r0"]


@pytest.mark.parametrize("cls", QUEUES)
def test_remove_is_by_identity(cls: type) -> None:
    # Two dataclass requests that are == (and unhashable): only the given object goes.
    a, b = DataReq("same"), DataReq("same")
    assert a == b
    q = cls()
    q.add_request(a)
    q.add_request(b)
    q.remove_request(b)
    assert len(q) == 1 and q.peek_request() is a
    q.add_request(b)
    q.remove_requests([a])
    assert len(q) == 1 and q.peek_request() is b
    assert b in q and a not in q


@pytest.mark.parametrize("cls", QUEUES)
def test_requests_never_compared_or_hashed(cls: type) -> None:
    reqs = [Hostile(1, 1.0) for _ in range(5)]
    q = cls()
    for r in reqs:
        q.add_request(r)
    q.prepend_request(Hostile(1, 1.0))
    q.prepend_requests([Hostile(1, 1.0), Hostile(1, 1.0)])
    q.remove_request(reqs[1])
    q.remove_requests([reqs[3], Hostile(1, 1.0)])
    assert reqs[0] in q
    list(q)
    q.peek_request()
    while q:
        q.pop_request()


@pytest.mark.parametrize("cls", QUEUES)
@pytest.mark.parametrize("kind", ["list", "set", "tuple", "generator", "fcfs", "priority"])
def test_remove_requests_iterable_kinds(cls: type, kind: str) -> None:
    reqs = make(6)
    q = cls()
    for r in reqs:
        q.add_request(r)
    victims = [reqs[4], reqs[0], reqs[2]]
    arg: Any
    if kind == "list":
        arg = victims
    elif kind == "set":
        arg = set(victims)
    elif kind == "tuple":
        arg = tuple(victims)
    elif kind == "generator":
        arg = (r for r in victims)
    else:
        arg = create_request_queue(kind)
        for r in victims:
            arg.add_request(r)
    q.remove_requests(arg)
    assert ids(q) == ["r1", "r3", "r5"]


@pytest.mark.parametrize("cls", QUEUES)
def test_remove_requests_edge_cases(cls: type) -> None:
    reqs = make(3)
    q = cls()
    for r in reqs:
        q.add_request(r)
    q.remove_requests([])  # nothing
    q.remove_requests([Req(), Req()])  # nothing present: no-op, no error
    assert ids(q) == ["r0", "r1", "r2"]
    q.remove_requests([reqs[1], Req(), reqs[1]])  # mixed + duplicates
    assert ids(q) == ["r0", "r2"]
    q.remove_requests(q)  # the queue itself: empties it, no mutation-during-iteration
    assert not q and len(q) == 0
    q.remove_requests(reqs)  # on an empty queue
    assert not q


class _NoContainsList(list):
    """A list that fails on `in` and counts iterations, to pin down O(n + m)."""

    iterations = 0

    def __contains__(self, item: object) -> bool:
        raise AssertionError("remove_requests must not do `x in list` (O(n*m))")

    def __iter__(self) -> Iterator[Any]:
        type(self).iterations += 1
        return super().__iter__()


@pytest.mark.parametrize("cls", QUEUES)
def test_remove_requests_single_pass_over_list(cls: type) -> None:
    reqs = make(2000)
    q = cls()
    for r in reqs:
        q.add_request(r)
    _NoContainsList.iterations = 0
    q.remove_requests(_NoContainsList(reqs[::2]))
    assert _NoContainsList.iterations == 1
    assert list(q) == reqs[1::2]


@pytest.mark.parametrize("cls", QUEUES)
def test_prepend_requests_from_itself(cls: type) -> None:
    q = cls()
    a, b = make(2)
    q.add_request(a)
    q.add_request(b)
    q.prepend_requests(q)  # must not raise "mutated during iteration"
    assert len(q) == 4
    assert sorted(ids(q)) == ["r0", "r0", "r1", "r1"]


@pytest.mark.parametrize("cls", QUEUES)
def test_constructor_accepts_initial_requests(cls: type) -> None:
    reqs = make(3)
    assert list(cls(reqs)) == reqs
    assert list(cls(iter(reqs))) == reqs


@pytest.mark.parametrize("cls", QUEUES)
def test_repr_lists_ids(cls: type) -> None:
    assert repr(cls(make(2))) == f"{cls.__name__}([r0, r1])"


# ---------------------------------------------------------------- FCFS specifics


def test_fcfs_fifo_ignores_priority() -> None:
    q = FCFSRequestQueue()
    reqs = [Req(5, 3.0), Req(0, 2.0), Req(9, 1.0)]
    for r in reqs:
        q.add_request(r)
    assert list(q) == reqs
    assert [q.pop_request() for _ in reqs] == reqs


def test_fcfs_prepend_request_goes_to_head() -> None:
    q = FCFSRequestQueue(make(2))
    x = Req(rid="x")
    q.prepend_request(x)
    assert q.peek_request() is x
    assert ids(q) == ["x", "r0", "r1"]
    assert q.pop_request() is x


def test_fcfs_prepend_requests_reverses_given_order() -> None:
    a, b, c, x = (Req(rid=n) for n in "abcx")
    q = FCFSRequestQueue([x])
    q.prepend_requests([a, b, c])
    assert ids(q) == ["c", "b", "a", "x"]  # like deque.extendleft
    q2 = FCFSRequestQueue([x])
    q2.prepend_requests(r for r in [a, b, c])
    assert ids(q2) == ["c", "b", "a", "x"]


def test_fcfs_skipped_queue_round_trip_restores_order() -> None:
    # The scheduler pushes skipped requests with prepend_request (reversing them),
    # then prepends the whole skipped queue back onto waiting (reversing again).
    a, b, c, w = (Req(rid=n) for n in "abcw")
    skipped = FCFSRequestQueue()
    for r in (a, b, c):
        skipped.prepend_request(r)
    assert ids(skipped) == ["c", "b", "a"]
    waiting = FCFSRequestQueue([w])
    waiting.prepend_requests(skipped)
    assert ids(waiting) == ["a", "b", "c", "w"]
    assert ids(skipped) == ["c", "b", "a"]  # source queue untouched


def test_fcfs_remove_duplicate_removes_first_occurrence() -> None:
    a, b = make(2)
    q = FCFSRequestQueue([a, b, a])
    q.remove_request(a)
    assert ids(q) == ["r1", "r0"]
    q.remove_requests([a])  # removes every occurrence
    assert ids(q) == ["r1"]


# ---------------------------------------------------------------- priority specifics


def test_priority_lower_value_first_then_arrival() -> None:
    q = PriorityRequestQueue()
    spec = [("late_hi", 0, 9.0), ("p2", 2, 0.0), ("early_hi", 0, 1.0), ("p1", 1, 0.5)]
    for rid, p, t in spec:
        q.add_request(Req(p, t, rid))
    assert q.peek_request().request_id == "early_hi"
    assert ids(q) == ["early_hi", "late_hi", "p1", "p2"]
    assert [q.pop_request().request_id for _ in spec] == ["early_hi", "late_hi", "p1", "p2"]


def test_priority_negative_priorities() -> None:
    q = PriorityRequestQueue([Req(0, 0.0, "zero"), Req(-5, 9.0, "neg")])
    assert q.pop_request().request_id == "neg"


def test_priority_full_ties_pop_in_insertion_order() -> None:
    reqs = [Req(3, 7.0, f"t{i}") for i in range(10)]
    q = PriorityRequestQueue()
    for r in reqs:
        q.add_request(r)
    assert list(q) == reqs
    assert [q.pop_request() for _ in reqs] == reqs


def test_priority_prepend_request_is_add_request() -> None:
    q = PriorityRequestQueue([Req(0, 0.0, "first"), Req(1, 0.0, "third")])
    q.prepend_request(Req(0, 5.0, "second"))  # no jumping the queue in a heap
    assert ids(q) == ["first", "second", "third"]
    q.prepend_request(Req(-1, 99.0, "top"))  # but its own priority still counts
    assert q.peek_request().request_id == "top"


def test_priority_prepend_requests_orders_by_priority() -> None:
    q = PriorityRequestQueue([Req(1, 0.0, "x")])
    q.prepend_requests([Req(2, 0.0, "c"), Req(0, 1.0, "b"), Req(0, 0.0, "a")])
    assert ids(q) == ["a", "b", "x", "c"]
    other = PriorityRequestQueue([Req(0, 0.5, "m")])
    q.prepend_requests(other)
    assert ids(q) == ["a", "m", "b", "x", "c"]
    assert ids(other) == ["m"]


def test_priority_remove_keeps_heap_valid() -> None:
    reqs = [Req(p, float(t)) for t, p in enumerate([5, 3, 8, 1, 9, 2, 7, 4, 6, 0])]
    q = PriorityRequestQueue(reqs)
    for victim in (reqs[3], reqs[0], reqs[9]):  # p=1, p=5, p=0 (the head)
        q.remove_request(victim)
    assert [q.pop_request().priority for _ in range(len(q))] == [2, 3, 4, 6, 7, 8, 9]


def test_priority_iter_does_not_disturb_heap() -> None:
    reqs = [Req(p, 0.0) for p in [4, 1, 3, 0, 2]]
    q = PriorityRequestQueue(reqs)
    heap_before = list(q._heap)
    it = iter(q)
    assert next(it).priority == 0
    q.add_request(Req(-1, 0.0))  # mutation during iteration is safe (snapshot)
    assert [r.priority for r in it] == [1, 2, 3, 4]
    assert q._heap[0][-1].priority == -1
    assert all(e in q._heap for e in heap_before)


# ---------------------------------------------------------------- factory


@pytest.mark.parametrize(
    "policy, cls",
    [
        (SchedulingPolicy.FCFS, FCFSRequestQueue),
        (SchedulingPolicy.PRIORITY, PriorityRequestQueue),
        ("fcfs", FCFSRequestQueue),
        ("priority", PriorityRequestQueue),
        ("FCFS", FCFSRequestQueue),
        ("Priority", PriorityRequestQueue),
        (" priority ", PriorityRequestQueue),
    ],
)
def test_factory(policy: Any, cls: type) -> None:
    q = create_request_queue(policy)
    assert type(q) is cls and not q
    assert create_request_queue(policy) is not q  # fresh instance every time


@pytest.mark.parametrize("bad", ["lifo", "", "fcfs2", None, 0])
def test_factory_unknown_policy(bad: Any) -> None:
    with pytest.raises(ValueError) as exc:
        create_request_queue(bad)
    msg = str(exc.value)
    assert "fcfs" in msg and "priority" in msg and repr(bad) in msg


# ---------------------------------------------------------------- property test

_key = st.tuples(st.integers(-2, 2), st.sampled_from([0.0, 0.5, 1.0]))  # many ties
_op = st.one_of(
    st.tuples(st.just("add"), _key),
    st.tuples(st.just("prepend"), _key),
    st.tuples(st.just("prepend_many"), st.lists(_key, max_size=4)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("peek")),
    st.tuples(st.just("remove"), st.integers(0, 1000), st.booleans()),
    st.tuples(
        st.just("remove_many"),
        st.lists(st.integers(0, 1000), max_size=5),
        st.sampled_from(["list", "set", "generator"]),
        st.booleans(),
    ),
)


class _Model:
    """Reference model: a plain list kept in pop order (sorted, for priority)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.items: list[tuple[int, float, int, Req]] = []
        self.seq = 0

    def _insert(self, r: Req, head: bool) -> None:
        self.seq += 1
        entry = (r.priority, r.arrival_time, self.seq, r)
        if self.policy is SchedulingPolicy.PRIORITY:
            self.items.append(entry)
            self.items.sort(key=lambda e: e[:3])
        elif head:
            self.items.insert(0, entry)
        else:
            self.items.append(entry)

    def add(self, r: Req) -> None:
        self._insert(r, head=False)

    def prepend(self, r: Req) -> None:
        self._insert(r, head=True)

    def remove_ids(self, idset: set[int]) -> None:
        self.items = [e for e in self.items if id(e[3]) not in idset]

    def order(self) -> list[Req]:
        return [e[3] for e in self.items]


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40))
def test_against_reference_model(policy: SchedulingPolicy, ops: list[tuple]) -> None:
    q = create_request_queue(policy)
    model = _Model(policy)
    for op in ops:
        name = op[0]
        if name == "add":
            r = Req(*op[1])
            q.add_request(r)
            model.add(r)
        elif name == "prepend":
            r = Req(*op[1])
            q.prepend_request(r)
            model.prepend(r)
        elif name == "prepend_many":
            batch = [Req(*k) for k in op[1]]
            q.prepend_requests(batch)
            for r in batch:  # extendleft semantics: one at a time to the head
                model.prepend(r)
        elif name in ("pop", "peek"):
            if not model.items:
                with pytest.raises(IndexError):
                    q.pop_request() if name == "pop" else q.peek_request()
            else:
                expected = model.items[0][3]
                if name == "pop":
                    model.items.pop(0)
                    assert q.pop_request() is expected
                else:
                    assert q.peek_request() is expected
        elif name == "remove":
            _, idx, absent = op
            if absent or not model.items:
                with pytest.raises(ValueError):
                    q.remove_request(Req())
            else:
                r = model.items[idx % len(model.items)][3]
                q.remove_request(r)
                model.remove_ids({id(r)})
        elif name == "remove_many":
            _, idxs, kind, with_absent = op
            victims = [model.items[i % len(model.items)][3] for i in idxs] if model.items else []
            if with_absent:
                victims.append(Req())
            arg: Any = {"list": list, "set": set, "generator": iter}[kind](victims)
            q.remove_requests(arg)
            model.remove_ids({id(v) for v in victims})
        assert len(q) == len(model.items)
        assert bool(q) == bool(model.items)
        assert list(q) == model.order()
    drained = [q.pop_request() for _ in range(len(q))]
    assert drained == model.order()
    assert not q
