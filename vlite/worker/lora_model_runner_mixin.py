"""The model runner's LoRA part (vLLM's LoRAModelRunnerMixin): the adapter manager, and each step's adapters.

With a LoRAConfig the runner's model gets LoRA layers (vlite.lora.manager); before each forward (_prepare_inputs)
the scheduled requests' adapters are put in slots and every row's slot is set (`lora_manager.set_active`). The
engine's adapter calls (add_lora, remove_lora, pin_lora, list_loras) land here, through the executor, on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from vlite.config import LoRAConfig
from vlite.lora.request import LoRARequest

if TYPE_CHECKING:
    from vlite.lora.manager import LoRAModelManager


class LoRAModelRunnerMixin:
    lora_manager: Optional[LoRAModelManager] = None

    def _init_lora(self, model: torch.nn.Module, lora_config: Optional[LoRAConfig], dtype: torch.dtype,
                   device: torch.device) -> None:
        if lora_config is None:
            return
        from vlite import _custom_ops
        from vlite.lora.manager import LoRAModelManager, tp_shard_fn

        ops = _custom_ops.load() if device.type == "cpu" else None  # None: the torch path (vlite.lora.layers)
        arch = model.config
        self.lora_manager = LoRAModelManager(model, arch, lora_config, dtype, device, ops, tp_shard_fn(arch))

    def _lora_manager(self) -> LoRAModelManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
        return self.lora_manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check the adapter (LoRAAdapterError for a bad folder); True if it was loaded now."""
        return self._lora_manager().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().pin_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self._lora_manager().list_loras() if self.lora_manager is not None else set()
