"""The model in the engine-core process: the runner's own methods, no copy or pickling in a step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from vlite.executor.abstract import Executor
from vlite.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
    from vlite.engine.arg_utils import LoadedEngineConfig
    from vlite.structured_output.manager import GrammarOutput


def build_model_runner(loaded: LoadedEngineConfig) -> ModelRunner:
    """The runner of `loaded`'s model (whatever part of it `loaded.arch` and `loaded.weights` hold)."""
    cfg = loaded.config
    if cfg.device_config.num_threads is not None:  # --threads / VLITE_NUM_THREADS: this process's pool
        import torch

        torch.set_num_threads(cfg.device_config.num_threads)
    return ModelRunner(loaded.arch, loaded.weights, loaded.torch_dtype, loaded.num_kv_blocks,
                       cfg.cache_config.block_size, cfg.scheduler_config.max_num_seqs,
                       cfg.scheduler_config.max_model_len, loaded.eos_token_ids, loaded.quantization,
                       cfg.speculative_config, device=loaded.device, enforce_eager=cfg.device_config.enforce_eager)


class UniProcExecutor(Executor):
    def __init__(self, loaded: LoadedEngineConfig) -> None:
        self.model_runner = build_model_runner(loaded)
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
