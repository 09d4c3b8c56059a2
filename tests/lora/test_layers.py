"""The LoRA layers on both paths, the C++ kernels (slots referencing the adapter's matrices) and torch (stacked slot
buffers, a GPU's or a machine without a compiler): each projection of a batch mixing two adapters, an empty slot and
base rows gives peft's outputs; a slot cleared or refilled with another adapter follows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.lora.peft_models import fused_output
from vlite import _custom_ops
from vlite.lora.layers import LoRALayer, LoRAStep
from vlite.lora.layout import PROJECTIONS, projection_shape
from vlite.lora.peft_adapter import load_peft_adapter

MAX_RANK = 8
SLOTS = [1, -1, 0, 1, 2, -1, 0, 0]  # slot 2 stays empty: its rows are the base model's


@pytest.fixture(params=["kernels", "torch"])
def ops(request: pytest.FixtureRequest) -> Any:
    if request.param == "torch":
        return None
    module = _custom_ops.load()
    if module is None:
        pytest.skip("no C++ kernels on this machine")
    return module


def test_layers_match_peft(ops: Any, base: Any, cfg: Any, adapters: dict) -> None:
    names = ["all", "regex"]  # slot 0, slot 1
    loras = [load_peft_adapter(adapters[n][0], cfg, MAX_RANK) for n in names]
    step = LoRAStep(ops, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for layer in range(cfg.num_hidden_layers):
        for projection in PROJECTIONS:
            lora = LoRALayer(cfg, layer, projection, 3, MAX_RANK, step, ops, torch.float32)
            for slot, adapter in enumerate(loras):
                lora.set_slot(slot, adapter)
            x = torch.randn(len(SLOTS), projection_shape(cfg, projection)[1], generator=gen)
            out = fused_output(base, layer, projection, cfg, x)
            expected = out.clone()
            for slot, name in enumerate(names):
                rows = torch.tensor(SLOTS) == slot
                expected[rows] = fused_output(adapters[name][1], layer, projection, cfg, x[rows])
            step.clear()
            lora.apply(out, x)  # no adapter rows this step: untouched
            torch.testing.assert_close(out, fused_output(base, layer, projection, cfg, x), rtol=0, atol=0)
            step.update(np.array(SLOTS))
            lora.apply(out, x)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            # slot 1 refilled with the first adapter, slot 0 cleared
            lora.set_slot(1, loras[0])
            lora.clear_slot(0)
            out = fused_output(base, layer, projection, cfg, x)
            expected = out.clone()
            rows = torch.tensor(SLOTS) == 1
            expected[rows] = fused_output(adapters["all"][1], layer, projection, cfg, x[rows])
            lora.apply(out, x)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
