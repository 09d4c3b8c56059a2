"""The mixture-of-experts block (vlite.layers.moe.SparseMoE) against a naive per-token reference (each
token's own softmax, top-k and weighted sum of its experts), against transformers' own Qwen3-MoE block,
and batched: each expert that has tokens runs once per step, whatever the number of tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vlite.layers.moe import SparseMoE
from vlite.layers.quantization import QuantizationPlan
from vlite.model_arch import ModelArchConfig
from vlite.model_loader.hf_config import arch_from_hf_config

HIDDEN, WIDTH, EXPERTS = 64, 32, 8


def _config(top_k: int, renormalize: bool) -> ModelArchConfig:
    return arch_from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_experts": EXPERTS, "num_experts_per_tok": top_k,
        "moe_intermediate_size": WIDTH, "norm_topk_prob": renormalize})


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"mlp.gate.weight": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.3}
    for e in range(EXPERTS):
        for name, shape in ("gate_proj", (WIDTH, HIDDEN)), ("up_proj", (WIDTH, HIDDEN)), ("down_proj", (HIDDEN, WIDTH)):
            w[f"mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.1
    return w


def _naive(x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int, renormalize: bool) -> torch.Tensor:
    """Token by token, in float64: the definition the batched block must compute."""
    w = {k: v.double() for k, v in w.items()}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        probs = torch.softmax(w["mlp.gate.weight"] @ row, dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            p = f"mlp.experts.{e}."
            act = F.silu(w[p + "gate_proj.weight"] @ row) * (w[p + "up_proj.weight"] @ row)
            out[t] += weight * (w[p + "down_proj.weight"] @ act)
    return out


@pytest.mark.parametrize("tokens", [1, 5, 97])
@pytest.mark.parametrize("top_k,renormalize", [(2, True), (2, False), (1, False), (EXPERTS, True)])
def test_matches_per_token_reference(tokens: int, top_k: int, renormalize: bool) -> None:
    w = _weights()
    moe = SparseMoE(_config(top_k, renormalize), w, "mlp", QuantizationPlan(None), torch.float32)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    expected = _naive(x, w, top_k, renormalize)
    torch.testing.assert_close(moe(x).double(), expected, atol=1e-5, rtol=1e-5)
    residual = torch.randn(tokens, HIDDEN)
    torch.testing.assert_close(moe(x, residual=residual).double(), expected + residual.double(), atol=1e-5, rtol=1e-5)


def test_each_expert_runs_once_per_step() -> None:
    """No loop over tokens: 300 tokens routed to 2 experts each make one call per expert that got any,
    over all of that expert's rows."""
    moe = SparseMoE(_config(2, True), _weights(), "mlp", QuantizationPlan(None), torch.float32)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_pre_hook(lambda module, args, e=e: calls.append((e, args[0].shape[0])))
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(1))
    moe(x)
    used, counts = torch.topk(F.linear(x, moe.gate_weight), 2).indices.unique(return_counts=True)
    assert calls == list(zip(used.tolist(), counts.tolist())) and len(calls) > 2


def test_matches_transformers_block() -> None:
    """transformers' Qwen3MoeSparseMoeBlock with the same weights: the same float32 output, bit for bit
    (the same rows per expert in the same order, summed per token in the same order)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    w = _weights(2)
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
                                               moe_intermediate_size=WIDTH, norm_topk_prob=True)).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(w["mlp.gate.weight"])
        for e in range(EXPERTS):
            p = f"mlp.experts.{e}."
            hf.experts.gate_up_proj[e].copy_(torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]))
            hf.experts.down_proj[e].copy_(w[p + "down_proj.weight"])
        x = torch.randn(1, 41, HIDDEN, generator=torch.Generator().manual_seed(3))
        expected = hf(x)[0]
    moe = SparseMoE(_config(2, True), w, "mlp", QuantizationPlan(None), torch.float32)
    assert torch.equal(moe(x[0]), expected)


@pytest.mark.parametrize("method,tol", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_experts_close(method: str, tol: float) -> None:
    """int8 / int4 plans quantize each expert's projections; the block stays close to the dense one."""
    w = _weights(4)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    dense = SparseMoE(_config(2, True), w, "mlp", QuantizationPlan(None), torch.float32)(x)
    quant: Any = SparseMoE(_config(2, True), w, "mlp", QuantizationPlan(method), torch.float32)
    assert type(quant.experts[0].down_weight).__name__ == "QuantizedLinear"
    err = (quant(x) - dense).norm() / dense.norm()
    assert err < tol, err
