"""config.json parsing (vlite.model_loader.hf_config): the older keys, EOS ids from both files, unknown
architectures named."""

from __future__ import annotations

import pytest

from vlite.model_loader.hf_config import arch_from_hf_config


def test_legacy_hf_config_keys() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rms_norm_eps": 1e-6,
        "eos_token_id": [5, 6],
        "rope_theta": 1234.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = arch_from_hf_config(base, {"eos_token_id": 9})
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == (5, 6, 9) and cfg.bos_token_id is None
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        arch_from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})
