"""The runner's recurrent-state slots (linear-attention layers, vlite.core.mamba_manager hands the slot numbers
out): per layer a conv state [S, conv_dim, K - 1] and a delta-rule state [S, Hv, Dk, Dv], float32."""

from __future__ import annotations

import torch

from vlite.model_arch import ModelArchConfig

LinearState = tuple[torch.Tensor, torch.Tensor]


def linear_state(arch: ModelArchConfig, num_slots: int, device: torch.device) -> LinearState:
    """One linear-attention layer's state slots (vlite.core.kv_cache_interface.MambaSpec's shapes)."""
    conv = torch.zeros(num_slots, arch.linear_conv_dim, arch.linear_conv_kernel_dim - 1, device=device)
    ssm = torch.zeros(num_slots, arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim,
                      device=device)
    return conv, ssm


def save_states(states: list[LinearState], saves: list[tuple[int, int]]) -> None:
    """Copy requests' states into the prefix cache's slots ((slot, cache slot) pairs), after the forward."""
    if saves:
        src, dst = (torch.tensor(x, device=states[0][0].device) for x in zip(*saves))
        for conv, ssm in states:
            conv[dst], ssm[dst] = conv[src], ssm[src]


def start_state(states: list[LinearState], slot: int, source: int) -> None:
    """A request's slot as it joins the batch: the saved state its prefix-cache hit ends with (`source` >= 0),
    else zeros."""
    for conv, ssm in states:
        if source >= 0:
            conv[slot], ssm[slot] = conv[source], ssm[source]
        else:
            conv[slot].zero_()
            ssm[slot].zero_()
