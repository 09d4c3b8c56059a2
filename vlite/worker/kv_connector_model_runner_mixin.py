"""The model runner's KV-connector part (vLLM's KVConnectorModelRunnerMixin), called at fixed points of a step.

    execute_model: start_load_kv (before anything, empty steps too) -> forward -> save_kv
    sample_tokens: the loads finished so far go back in ModelRunnerOutput.kv_connector_output

Each runner (each tensor-parallel rank) holds its own worker-side connector over its own KV cache tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from vlite.core.sched.output import ModelRunnerOutput, SchedulerOutput
from vlite.kv_connector.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    import torch

    from vlite.config import LoadedEngineConfig


class KVConnectorModelRunnerMixin:
    kv_connector: Optional[KVConnectorBase] = None
    kv_caches: list[torch.Tensor]
    _kv_step_idle = False

    def init_kv_connector(self, loaded: LoadedEngineConfig, rank: int) -> None:
        """The worker side of the engine's connector (kv_transfer_config), over this runner's KV cache."""
        from vlite.kv_connector.factory import create_kv_connector

        connector = create_kv_connector(loaded, KVConnectorRole.WORKER, rank)
        if connector is not None and self.kv_caches:
            connector.register_kv_caches(self.kv_caches)
            self.kv_connector = connector

    def _kv_connector_start_step(self, scheduler_output: SchedulerOutput) -> None:
        self._kv_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        meta = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None and meta is not None and meta.loads:
            self.kv_connector.start_load_kv(meta)

    def _kv_connector_after_forward(self, scheduler_output: SchedulerOutput) -> None:
        meta = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None and meta is not None and meta.saves:
            self.kv_connector.save_kv(meta)

    def _kv_connector_output(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        if self.kv_connector is not None:
            output.kv_connector_output = self.kv_connector.get_finished(self._kv_step_idle)
        return output

    def shutdown_kv_connector(self) -> None:
        """Write the pending saves and stop the connector's threads."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
