"""The model in the engine-core process: the runner's own methods, no copy or pickling in a step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from vlite.executor.abstract import Executor
from vlite.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.config import LoadedEngineConfig
    from vlite.lora.request import LoRARequest
    from vlite.structured_output.manager import GrammarOutput


class UniProcExecutor(Executor):
    def __init__(self, loaded: LoadedEngineConfig) -> None:
        self.model_runner = ModelRunner.from_loaded(loaded)
        loaded.weights = {}  # the model holds what it needs; drop the loader's references
        # The runner's bound methods themselves: a step costs what it did before the executor layer.
        self.execute_model = self.model_runner.execute_model  # type: ignore[method-assign]
        self.sample_tokens = self.model_runner.sample_tokens  # type: ignore[method-assign]
        self.reset = self.model_runner.reset  # type: ignore[method-assign]

    # (Shadowed by the bound methods above; here for the interface.)
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Optional[GrammarOutput] = None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def reset(self) -> None:
        self.model_runner.reset()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.model_runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.model_runner.list_loras()

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.pin_lora(lora_int_id)

    def shutdown(self) -> None:
        self.model_runner.shutdown_kv_connector()  # pending KV block saves reach the disk
