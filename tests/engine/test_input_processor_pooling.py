"""InputProcessor's pooling path: the plain texts of a batch tokenized in one call (tokenize_pooling_texts) give
each request exactly what tokenizing it on its own gives, sentence-transformers' steps (default prompt,
lowercasing) and truncation included; what is not plain text is left to process_pooling_inputs."""

from __future__ import annotations

import pytest

from tests.models import tiny
from vlite.engine.input_processor import InputProcessor
from vlite.pooling.config import PoolerConfig
from vlite.pooling_params import PoolingParams


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.tiny_tokenizer()


def _processor(tokenizer, config: PoolerConfig) -> InputProcessor:
    processor = InputProcessor(tokenizer, max_model_len=64, vocab_size=tiny.VOCAB_SIZE, kv_capacity_tokens=256,
                               eos_token_ids=(2,))
    processor.pooler_config, processor.hidden_size = config, 8
    return processor


@pytest.mark.parametrize("config", [PoolerConfig(pooling_type="MEAN"),
                                    PoolerConfig(pooling_type="MEAN", do_lower_case=True,
                                                 prompts={"query": "Query: "}, default_prompt_name="query")])
def test_batched_texts_equal_one_by_one(tokenizer, config):
    processor = _processor(tokenizer, config)
    prompts = ["def f(x): return x", {"prompt": "Import OS and SYS"}, "a " * 100, {"prompt_token_ids": [5, 6, 7]},
               "x = [1, 2, 3]", {"prompt": "for i in range(3):", "prompt_pair": "pass"}, ""]
    params = [PoolingParams(), PoolingParams(truncate_prompt_tokens=4), PoolingParams(truncate_prompt_tokens=-1),
              PoolingParams(), PoolingParams(truncate_prompt_tokens=12), PoolingParams(), PoolingParams()]
    encoded = processor.tokenize_pooling_texts(prompts, params)
    assert encoded[3] is None and encoded[5] is None and encoded[6] is None  # ids, a pair, empty text
    for i, (prompt, p, ids) in enumerate(zip(prompts, params, encoded)):
        if i == 6:
            with pytest.raises(ValueError, match="empty"):
                processor.process_pooling_inputs(f"r{i}", prompt, p, encoded=ids)
            continue
        alone = processor.process_pooling_inputs(f"r{i}", prompt, p)
        batched = processor.process_pooling_inputs(f"r{i}", prompt, p, encoded=ids)
        assert batched[0] == alone[0] and batched[1].prompt_token_ids == alone[1].prompt_token_ids, i
    lengths = [len(e) for e in encoded if e is not None]
    assert lengths[1] == 4 and lengths[2] == 64  # truncated to the request's limit, -1: max_model_len
    if config.do_lower_case:
        text, _ = processor.process_pooling_inputs("r", "Import OS", PoolingParams(), encoded=None)
        assert text == "query: import os"
