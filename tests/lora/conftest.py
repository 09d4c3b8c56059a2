"""A tiny Llama and peft adapters made on it (plain, rsLoRA, "all-linear", a regex of modules), per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.lora.peft_models import ALL, make_adapter
from tests.models import tiny


@pytest.fixture(scope="module")
def base() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="module")
def cfg(base: Any) -> Any:
    from vlite.model_loader.hf_config import arch_from_hf_config

    return arch_from_hf_config(base.config.to_dict())


@pytest.fixture(scope="module")
def adapters(base: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (folder, peft's model with the adapter)."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    specs = {"all": dict(r=4, lora_alpha=8, target_modules=ALL),
             "rslora_qv": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
             "all_linear": dict(r=2, lora_alpha=3, target_modules="all-linear"),
             "regex": dict(r=3, lora_alpha=5, target_modules=r".*\.(k_proj|down_proj)")}
    return {name: (root / name, make_adapter(base, root / name, seed=i, **spec))
            for i, (name, spec) in enumerate(specs.items())}
