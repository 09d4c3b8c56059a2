"""LoRA adapter calls through the executors, on fake runners (no model): every rank does it, rank 0 answers; an
adapter refused on every rank is raised to the caller as its own exception and the executor serves on; one
refused on some ranks only is undone on the others; a rank that does not answer still ends the executor."""

from __future__ import annotations

import pickle
from typing import Any, Optional

import pytest

from vlite.executor import ExecutorDeadError
from vlite.executor.abstract import Replies, WorkerGroupExecutor
from vlite.executor.uniproc_executor import UniProcExecutor
from vlite.lora.peft_adapter import LoRAAdapterError
from vlite.lora.request import LoRARequest
from vlite.worker.worker import Worker

GOOD = LoRARequest("good", 1, "/adapters/good")
BAD = LoRARequest("bad", 2, "/adapters/missing")


class FakeRunner:
    """The ModelRunner's adapter API; `bad_paths`: folders this rank cannot read."""

    def __init__(self, bad_paths: tuple[str, ...] = ()) -> None:
        self.loaded: dict[int, LoRARequest] = {}
        self.pinned: set[int] = set()
        self.bad_paths = bad_paths

    def add_lora(self, lora_request: LoRARequest) -> bool:
        if lora_request.lora_path in self.bad_paths:
            raise LoRAAdapterError(lora_request.lora_path, "no adapter_config.json")
        new = lora_request.lora_int_id not in self.loaded
        self.loaded[lora_request.lora_int_id] = lora_request
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loaded)

    def pin_lora(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.loaded:
            raise ValueError(f"LoRA adapter id {lora_int_id} is not loaded")
        self.pinned.add(lora_int_id)
        return True


def make_worker(rank: int, runner: FakeRunner) -> Worker:
    worker = Worker.__new__(Worker)
    worker.rank, worker.runner, worker._pending_error = rank, runner, None
    return worker


class FakeGroup(WorkerGroupExecutor):
    """The ranks' Worker.handle called in this process, each reply pickled as a pipe or Ray would carry it."""

    def __init__(self, runners: list[FakeRunner], silent: Optional[int] = None) -> None:
        self.workers = [make_worker(r, runner) for r, runner in enumerate(runners)]
        self.silent = silent  # a rank that never answers
        self._dead = None
        self.killed = False

    def _call_all(self, method: str, arg: Any = None) -> Replies:
        self.check_health()
        replies = Replies(len(self.workers), timeout=0.0)
        for rank, worker in enumerate(self.workers):
            reply = pickle.loads(pickle.dumps(worker.handle(method, arg)))
            if rank != self.silent:
                replies.add(rank, reply)
        return replies

    def _kill_workers(self) -> None:
        self.killed = True

    def execute_model(self, scheduler_output):  # not used here
        raise NotImplementedError

    def sample_tokens(self, grammar_output=None):
        raise NotImplementedError

    def reset(self) -> None:
        pass


def test_every_rank_loads_rank_zero_answers():
    runners = [FakeRunner(), FakeRunner()]
    ex = FakeGroup(runners)
    assert ex.add_lora(GOOD) is True
    assert ex.add_lora(GOOD) is False
    assert ex.list_loras() == {1} and all(r.list_loras() == {1} for r in runners)
    assert ex.pin_lora(1) is True and all(r.pinned == {1} for r in runners)
    assert ex.remove_lora(1) is True and ex.remove_lora(1) is False
    assert ex.list_loras() == set()


def test_adapter_refused_everywhere_raises_its_error_and_serves_on():
    ex = FakeGroup([FakeRunner(bad_paths=(BAD.lora_path,)), FakeRunner(bad_paths=(BAD.lora_path,))])
    with pytest.raises(LoRAAdapterError, match="/adapters/missing: no adapter_config.json"):
        ex.add_lora(BAD)
    with pytest.raises(ValueError, match="id 7 is not loaded"):
        ex.pin_lora(7)
    ex.check_health()
    assert not ex.killed
    assert ex.add_lora(GOOD) is True and ex.list_loras() == {1}


def test_adapter_refused_on_one_rank_is_undone_on_the_others():
    runners = [FakeRunner(), FakeRunner(bad_paths=(BAD.lora_path,))]  # e.g. the folder is missing on rank 1's node
    ex = FakeGroup(runners)
    ex.add_lora(GOOD)
    with pytest.raises(LoRAAdapterError):
        ex.add_lora(BAD)
    assert [r.list_loras() for r in runners] == [{1}, {1}]  # rank 0 dropped it again; GOOD untouched
    ex.check_health()


def test_a_rank_that_does_not_answer_ends_the_executor():
    ex = FakeGroup([FakeRunner(), FakeRunner()], silent=1)
    with pytest.raises(ExecutorDeadError, match="did not answer"):
        ex.add_lora(GOOD)
    assert ex.killed


def test_worker_sends_exceptions_that_unpickle():
    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    class OddRunner(FakeRunner):
        def remove_lora(self, lora_int_id: int) -> bool:
            raise Odd(1, 2)

    kind, err = pickle.loads(pickle.dumps(make_worker(0, OddRunner()).handle("remove_lora", 3)))
    assert kind == "error" and isinstance(err, RuntimeError) and "Odd: 1/2" in str(err)
    kind, err = pickle.loads(pickle.dumps(make_worker(0, FakeRunner((BAD.lora_path,))).handle("add_lora", BAD)))
    assert kind == "error" and type(err) is LoRAAdapterError and err.path == BAD.lora_path


def test_uni_executor_calls_the_runner():
    ex = UniProcExecutor.__new__(UniProcExecutor)
    ex.model_runner = FakeRunner(bad_paths=(BAD.lora_path,))
    assert ex.add_lora(GOOD) is True and ex.list_loras() == {1} and ex.pin_lora(1)
    with pytest.raises(LoRAAdapterError):
        ex.add_lora(BAD)
    assert ex.remove_lora(1) and ex.list_loras() == set()
