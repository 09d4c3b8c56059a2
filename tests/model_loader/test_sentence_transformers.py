"""vlite.model_loader.sentence_transformers: a folder's PoolerConfig from its sentence-transformers files
(modules.json, the Pooling / Dense modules' configs, sentence_bert_config.json, prompts, Matryoshka keys),
defaults without them, cross-encoder activations; and model folders given as a .zip (model_zip)."""

from __future__ import annotations

import json
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vlite.model_arch import ModelArchConfig
from vlite.model_loader.resolve import resolve_model
from vlite.model_loader.sentence_transformers import pooler_config_from_folder
from vlite.pooling.config import PoolingType

ENCODER = ModelArchConfig("bert", 100, 8, 16, 1, 2, 2, 4, 1e-12, 0.0, None, 64, False, None, (), hidden_act="gelu",
                          is_causal=False)
DECODER = ModelArchConfig("llama", 100, 8, 16, 1, 2, 2, 4, 1e-6, 1e4, None, 64, False, None, (2,))
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}


def write(folder: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content))
    return folder


def module(idx: int, kind: str, path: str) -> dict[str, Any]:
    return {"idx": idx, "name": str(idx), "path": path, "type": f"sentence_transformers.models.{kind}"}


def test_mean_normalized_with_legacy_flags(tmp_path: Path) -> None:
    write(tmp_path, {"modules.json": [TRANSFORMER, module(1, "Pooling", "1_Pooling"), module(2, "Normalize", "2_Normalize")],
                     "1_Pooling/config.json": {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
                                               "pooling_mode_mean_tokens": True},
                     "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": True}})
    cfg = pooler_config_from_folder(tmp_path, ENCODER)
    assert (cfg.task, cfg.pooling_type, cfg.normalize, cfg.include_prompt) == ("embed", PoolingType.MEAN, True, True)
    assert cfg.max_seq_length == 256 and cfg.do_lower_case and cfg.dense == ()


def test_lasttoken_dense_prompts_matryoshka(tmp_path: Path) -> None:
    write(tmp_path, {"modules.json": [TRANSFORMER, module(1, "Pooling", "1_Pooling"), module(2, "Dense", "2_Dense")],
                     "1_Pooling/config.json": {"pooling_mode": "lasttoken", "include_prompt": False},
                     "2_Dense/config.json": {"in_features": 8, "out_features": 4, "bias": False,
                                             "activation_function": "torch.nn.modules.linear.Identity"},
                     "config_sentence_transformers.json": {"prompts": {"query": "Query: "}, "default_prompt_name": "query",
                                                           "similarity_fn_name": "cosine"},
                     "config.json": {"is_matryoshka": True, "matryoshka_dimensions": [2, 4]}})
    cfg = pooler_config_from_folder(tmp_path, DECODER)
    assert cfg.pooling_type == PoolingType.LAST and not cfg.include_prompt and not cfg.normalize
    (dense,) = cfg.dense
    assert (dense.in_features, dense.out_features, dense.bias, dense.activation) == (8, 4, False, "identity")
    assert dense.folder == str(tmp_path / "2_Dense") and cfg.output_size == 4
    assert cfg.prompts == {"query": "Query: "} and cfg.default_prompt_name == "query"
    assert cfg.is_matryoshka and cfg.matryoshka_dimensions == (2, 4) and cfg.similarity_fn_name == "cosine"


def test_defaults_without_modules_json(tmp_path: Path) -> None:
    assert pooler_config_from_folder(tmp_path, ENCODER).pooling_type == PoolingType.CLS
    cfg = pooler_config_from_folder(tmp_path, DECODER)
    assert cfg.pooling_type == PoolingType.LAST and cfg.normalize


def test_unsupported_modes_refused(tmp_path: Path) -> None:
    write(tmp_path, {"modules.json": [TRANSFORMER, module(1, "Pooling", "1_Pooling")],
                     "1_Pooling/config.json": {"pooling_mode": "weightedmean"}})
    with pytest.raises(ValueError, match="weightedmean"):
        pooler_config_from_folder(tmp_path, ENCODER)


@pytest.mark.parametrize("labels, st_config, activation", [
    (1, None, "sigmoid"), (3, None, "softmax"),
    (1, {"activation_fn": "torch.nn.modules.linear.Identity"}, "identity")])
def test_cross_encoder(tmp_path: Path, labels: int, st_config: Any, activation: str) -> None:
    config = {"architectures": ["BertForSequenceClassification"], "num_labels": labels}
    if st_config:
        config["sentence_transformers"] = st_config
    write(tmp_path, {"config.json": config})
    cfg = pooler_config_from_folder(tmp_path, replace(ENCODER, classifier="bert", num_labels=labels))
    assert (cfg.task, cfg.pooling_type, cfg.activation, cfg.num_labels) == ("classify", PoolingType.CLS, activation,
                                                                              labels)


@pytest.mark.parametrize("nested", [False, True])
def test_zip_of_a_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nested: bool) -> None:
    """A .zip resolves to its folder, extracted once into the cache (files at the root or in one folder)."""
    monkeypatch.setenv("VLITE_CACHE_DIR", str(tmp_path / "cache"))
    archive = tmp_path / "model.zip"
    inner = "m/" if nested else ""
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(inner + "config.json", json.dumps({"architectures": ["BertModel"]}))
        z.writestr(inner + "model.safetensors", b"")
    first = resolve_model(str(archive))
    assert (first.path / "config.json").is_file() and first.path.is_relative_to(tmp_path / "cache")
    mtime = (first.path / "config.json").stat().st_mtime_ns
    assert resolve_model(str(archive)).path == first.path  # not extracted again
    assert (first.path / "config.json").stat().st_mtime_ns == mtime
