"""LLM(runner="pooling") on tiny random models against transformers: an encoder's embeddings (several prompts in
one step, no KV cache), a cross-encoder's scores with token types, a decoder as a LAST-pooling embedder whose
chunked prompts reuse the prefix cache; bad input refused before any work, naming the field and its limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.models import encoders, tiny
from vlite import LLM
from vlite.pooling_params import PoolingParams


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[Path, object]:
    from transformers import BertConfig, BertModel

    hf = encoders.build(BertConfig, BertModel)
    folder = encoders.save(hf, tmp_path_factory.mktemp("bert"))
    tiny.tiny_tokenizer().save_pretrained(folder)  # the engine loads one; these tests send token ids
    return folder, hf


@pytest.fixture(scope="module")
def bert_llm(bert) -> LLM:
    return LLM(str(bert[0]), dtype="float32", max_num_batched_tokens=256)


def _ids(seqs: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": s} for s in seqs]


def test_encoder_embeddings_equal_transformers_cls_normalized(bert, bert_llm):
    folder, hf = bert
    seqs = encoders.sequences()
    outs = bert_llm.embed(_ids(seqs), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == seqs  # input order
    with torch.no_grad():
        for out, s in zip(outs, seqs):
            ref = F.normalize(hf(torch.tensor([s])).last_hidden_state[0, 0], dim=-1)  # vLLM's encoder default
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=0)
    m = bert_llm.get_metrics()
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    # normalize=False: the raw CLS state
    raw = bert_llm.embed(_ids(seqs[:1]), pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(raw.outputs.embedding),
                                   hf(torch.tensor(seqs[:1])).last_hidden_state[0, 0], atol=1e-5, rtol=0)


def test_encoder_bad_input_refused_before_any_work(bert_llm):
    long = list(range(3, 3 + 81))  # the tiny BERT's limit is 80 positions
    cases = [([{"prompt_token_ids": []}], "0 tokens"), ([{"prompt_token_ids": [5, 999]}], "outside the vocabulary"),
             ([{"prompt_token_ids": long}], "max_model_len (80)")]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            bert_llm.embed(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        bert_llm.embed(_ids([[5, 6]]), pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        bert_llm.generate(_ids([[5, 6]]), use_tqdm=False)
    # truncation keeps the last n token ids, then it runs; nothing was left behind by the refusals
    out = bert_llm.embed([{"prompt_token_ids": long}], truncate_prompt_tokens=80, use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-80:]
    assert bert_llm.get_metrics()["num_requests_waiting"] == 0


def test_cross_encoder_scores_with_token_types(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    hf = encoders.build(BertConfig, BertForSequenceClassification, num_labels=1)
    folder = encoders.save(hf, tmp_path / "ce")
    tiny.tiny_tokenizer().save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32")
    seqs = encoders.sequences()
    types = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    prompts = [{"prompt_token_ids": s, "token_type_ids": t} for s, t in zip(seqs, types)]
    outs = llm.encode(prompts, use_tqdm=False)
    with torch.no_grad():
        for out, s, t in zip(outs, seqs, types):
            logit = hf(torch.tensor([s]), token_type_ids=torch.tensor([t])).logits[0]
            torch.testing.assert_close(out.outputs.data, torch.sigmoid(logit), atol=1e-5, rtol=0)
    raw = llm.encode(prompts[:1], PoolingParams(activation=False), use_tqdm=False)[0]
    with torch.no_grad():
        torch.testing.assert_close(raw.outputs.data, hf(torch.tensor(seqs[:1]), token_type_ids=torch.tensor(
            types[:1])).logits[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="task 'embed'"):
        llm.embed(prompts[:1], use_tqdm=False)


def test_decoder_embedder_last_pooling_chunked_and_prefix_cached(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tiny.build(LlamaConfig, LlamaForCausalLM)
    folder = tiny.save_hf(hf, tiny.tiny_tokenizer(), tmp_path / "llama")
    # a 16-token budget: the 60-token prompts run in chunks; LAST pooling takes the final token's state
    llm = LLM(str(folder), dtype="float32", runner="pooling", max_num_batched_tokens=16)
    shared = list(range(10, 58))
    seqs = [shared + [70, 71, 72, 73], shared + [80, 81], [5, 6, 7]]
    first = llm.embed(_ids(seqs), use_tqdm=False)
    with torch.no_grad():
        for out, s in zip(first, seqs):
            ref = F.normalize(hf.model(torch.tensor([s])).last_hidden_state[0, -1], dim=-1)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=0)
    hits = llm.get_metrics()["prefix_cache_hits"]
    again = llm.embed(_ids(seqs), use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] - hits >= 2 * 48  # the shared prefix's full blocks, both times
    for a, b in zip(first, again):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                                   atol=1e-5, rtol=0)
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]  # nothing leaked
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("hello", use_tqdm=False)


@pytest.mark.parametrize("arch,num_labels", [("Llama", 3), ("Qwen2", 1)])
def test_decoder_sequence_classifier_last_token_chunked(tmp_path, arch, num_labels):
    """XForSequenceClassification: the decoder's final-norm state of each prompt's last token through `score`
    (transformers' pooling without padding), softmax over several labels, sigmoid over one; the runner is
    pooling without asking, prompts chunked (16-token budget) and their prefixes served from the cache."""
    import transformers

    hf = tiny.build(getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForSequenceClassification"),
                    num_labels=num_labels)
    folder = tiny.save_hf(hf, tiny.tiny_tokenizer(), tmp_path / arch)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16)
    shared = list(range(10, 50))
    seqs = [shared + [70, 71, 72], shared + [80], [5, 6, 7]]
    with torch.no_grad():
        logits = [hf(torch.tensor([s])).logits[0] for s in seqs]
    act = torch.sigmoid if num_labels == 1 else (lambda x: torch.softmax(x, -1))
    for _ in range(2):  # the second time the shared prefix comes from the cache
        outs = llm.classify(_ids(seqs), use_tqdm=False)
        for out, ref in zip(outs, logits):
            assert out.outputs.num_classes == num_labels
            torch.testing.assert_close(torch.tensor(out.outputs.probs), act(ref), atol=1e-5, rtol=0)
    assert llm.get_metrics()["prefix_cache_hits"] >= 32
    raw = llm.encode(_ids(seqs[:1]), PoolingParams(activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(raw.outputs.data, logits[0], atol=1e-5, rtol=0)
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    with pytest.raises(ValueError, match="task 'embed'"):
        llm.embed(_ids(seqs[:1]), use_tqdm=False)
    with pytest.raises(ValueError, match="sequence classifier"):
        LLM(str(folder), dtype="float32", runner="generate")


def test_instruction_prompt_left_out_of_the_pooling(tmp_path):
    """A sentence-transformers pipeline with a default prompt and include_prompt False (instruction models): the
    prompt goes before the text, and MEAN pooling leaves its tokens out as sentence-transformers does (its
    prompt_length: the prompt's own ids less one)."""
    import json

    from transformers import BertConfig, BertModel

    from tests.model_loader.test_sentence_transformers import TRANSFORMER, module, write

    hf = encoders.build(BertConfig, BertModel, vocab_size=tiny.VOCAB_SIZE)
    st = encoders.save(hf, tmp_path / "st")
    tiny.tiny_tokenizer().save_pretrained(st)
    write(st, {"modules.json": [TRANSFORMER, module(1, "Pooling", "1_Pooling")],
               "1_Pooling/config.json": {"pooling_mode": "mean", "include_prompt": False},
               "config_sentence_transformers.json": {"prompts": {"query": "Represent this code: "},
                                                     "default_prompt_name": "query"}})
    llm = LLM(str(st), dtype="float32", max_num_batched_tokens=256)
    tok = llm.get_tokenizer()
    skip = len(tok("Represent this code: ")["input_ids"]) - 1
    texts = ["def add(a, b):", "import os"]
    outs = llm.embed(texts, use_tqdm=False)
    with torch.no_grad():
        for out, text in zip(outs, texts):
            ids = tok("Represent this code: " + text)["input_ids"]
            assert out.prompt_token_ids == ids and len(ids) > skip > 0
            ref = hf(torch.tensor([ids])).last_hidden_state[0, skip:].mean(0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=0)
    # token ids come without the prompt: every token is pooled
    ids = tok("import os")["input_ids"]
    out = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                                   hf(torch.tensor([ids])).last_hidden_state[0].mean(0), atol=1e-5, rtol=0)
    assert json.loads((st / "1_Pooling/config.json").read_text())["include_prompt"] is False
