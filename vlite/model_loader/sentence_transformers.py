"""A model folder's pooling as a `PoolerConfig` (vlite.pooling.config), as sentence-transformers reads it.

    modules.json: [Transformer (path "", its sentence_bert_config.json: max_seq_length, do_lower_case),
                   Pooling (e.g. 1_Pooling/config.json: pooling_mode or the pooling_mode_*_tokens flags,
                            include_prompt),
                   Dense* (e.g. 2_Dense/config.json: in/out_features, bias, activation_function;
                           weights in that folder), Normalize?]
    config_sentence_transformers.json: prompts, default_prompt_name, similarity_fn_name
    config.json: is_matryoshka / matryoshka_dimensions (as vLLM reads them)

A folder without modules.json pools as vLLM does by default: CLS for encoders, LAST for decoders, normalized.
A sequence-classification checkpoint (a CrossEncoder folder) classifies on the first token: activation from
config.json's sentence_transformers.activation_fn, else sigmoid for one label and softmax for several.
No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from vlite.model_arch import ModelArchConfig
from vlite.pooling.config import ACTIVATIONS, DenseLayer, PoolerConfig, PoolingType

__all__ = ["pooler_config_from_folder"]

_MODES = {"mean": PoolingType.MEAN, "mean_sqrt_len_tokens": PoolingType.MEAN_SQRT_LEN, "cls": PoolingType.CLS,
          "max": PoolingType.MAX, "lasttoken": PoolingType.LAST}
# The legacy 1_Pooling/config.json flags, in sentence-transformers' order.
_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
          "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _json(path: Path) -> Optional[Any]:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def pooler_config_from_folder(folder: Path, arch: ModelArchConfig) -> PoolerConfig:
    """The folder's PoolerConfig; `arch` is its model's record (encoder or decoder, classification head)."""
    folder = Path(folder)
    config = _json(folder / "config.json") or {}
    st = _json(folder / "config_sentence_transformers.json") or {}
    common: dict[str, Any] = {
        "prompts": dict(st.get("prompts") or {}), "default_prompt_name": st.get("default_prompt_name"),
        "similarity_fn_name": st.get("similarity_fn_name"),
        "is_matryoshka": bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")),
        "matryoshka_dimensions": config.get("matryoshka_dimensions")}
    modules = _json(folder / "modules.json")
    transformer = next((m for m in modules or () if m["type"].endswith(".Transformer")), {"path": ""})
    common.update(_transformer_settings(folder / transformer.get("path", "")))
    if arch.classifier:  # an encoder's head reads the first token, a decoder's the last
        return PoolerConfig(task="classify", pooling_type=PoolingType.LAST if arch.is_causal else PoolingType.CLS,
                            normalize=False,
                            num_labels=arch.num_labels, activation=_classifier_activation(config, arch.num_labels),
                            **common)
    if modules is None:
        return PoolerConfig(pooling_type=PoolingType.LAST if arch.is_causal else PoolingType.CLS, **common)
    pooling: dict[str, Any] = {"pooling_type": PoolingType.LAST if arch.is_causal else PoolingType.CLS}
    dense: list[DenseLayer] = []
    normalize = False
    for m in modules:
        kind, path = m["type"].rsplit(".", 1)[-1], folder / m.get("path", "")
        if kind == "Pooling":
            pooling = _pooling(_json(path / "config.json") or {}, path)
        elif kind == "Dense":
            dense.append(_dense(_json(path / "config.json") or {}, path))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{folder}: sentence-transformers module {m['type']!r} is not supported")
    return PoolerConfig(normalize=normalize, dense=tuple(dense), **pooling, **common)


def _transformer_settings(path: Path) -> dict[str, Any]:
    cfg = _json(path / "sentence_bert_config.json") or {}
    out: dict[str, Any] = {"do_lower_case": bool(cfg.get("do_lower_case", False))}
    if cfg.get("max_seq_length") is not None:
        out["max_seq_length"] = int(cfg["max_seq_length"])
    return out


def _pooling(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    mode = cfg.get("pooling_mode")
    if mode is None:
        mode = [name for flag, name in _FLAGS.items() if cfg.get(flag)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(f"{path}: pooling mode {mode!r} is not supported (one of: {', '.join(_MODES)})")
    return {"pooling_type": _MODES[modes[0]], "include_prompt": bool(cfg.get("include_prompt", True))}


def _activation(name: Optional[str], path: Path) -> str:
    """A torch.nn activation's dotted class path as ACTIVATIONS' name ("identity" for None)."""
    if not name:
        return "identity"
    short = name.rsplit(".", 1)[-1]
    if short not in ACTIVATIONS:
        raise ValueError(f"{path}: activation {name!r} is not supported (one of: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[short]


def _dense(cfg: dict[str, Any], path: Path) -> DenseLayer:
    return DenseLayer(folder=str(path), in_features=int(cfg["in_features"]), out_features=int(cfg["out_features"]),
                      bias=bool(cfg.get("bias", True)),
                      activation=_activation(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"), path))


def _classifier_activation(config: dict[str, Any], num_labels: int) -> str:
    st = config.get("sentence_transformers") or {}
    name = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    if name:
        return _activation(name, Path("config.json"))
    return "sigmoid" if num_labels == 1 else "softmax"
