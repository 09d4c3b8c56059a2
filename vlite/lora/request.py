"""The adapter a request runs under, named as vLLM names it (`vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter, by name (what users and `model: "<adapter>"` call it), engine id and folder.

    Two requests are the same adapter when their names are equal (as vLLM's LoRARequest compares them: a
    name identifies an adapter across engines); the engine counts adapters per step, keys slots and
    prefix-cache hashes by `lora_int_id`, which must therefore be unique per name.
    """

    lora_name: str  # the adapter's name, non-empty
    lora_int_id: int  # the engine's id of the adapter, >= 1 (0 stands for "no adapter")
    lora_path: str  # the PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
