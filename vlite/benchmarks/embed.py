"""`vlite bench embed`: sentences per second of a pooling model's LLM.embed, beside sentence-transformers.

The sentences are made reproducibly from a fixed word list (lengths spread over --min-words..--max-words, as a
retrieval corpus's passages are), all given to one `LLM.embed` call (the engine batches them up to its token
budget, padded nowhere); the reference is `SentenceTransformer(model).encode(batch_size=32)` on the same texts
with the same torch threads, in float32 as it loads. The cosine between the two sets is printed with them.

With --base-url it measures a running server instead (`vlite serve MODEL --runner pooling`): --num-sentences
/v1/embeddings requests of one sentence each, one at a time, and the percentiles of their latency (what a
retrieval pipeline embedding its query waits).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from vlite.benchmarks.utils import add_output_args, jsonable_args, write_json
from vlite.entrypoints.cli.args import positive_int

HELP = "pooling model: sentences/s of LLM.embed, beside SentenceTransformer.encode on the same texts"
DESCRIPTION = ("Embedding throughput: --num-sentences texts in one LLM.embed call, then (unless --no-reference) "
               "SentenceTransformer(model).encode(batch_size=32) on the same texts and threads; sentences/s and the "
               "lowest cosine between the two.")

_WORDS = ("the a of to and in is for on with that as by from at an be this are or it was which can data model "
          "system search query retrieval document engine embedding vector semantic language learning network "
          "time first new used results based performance memory large small fast slow research paper method "
          "question answer city river music history science water energy market policy health school").split()


def sentences(n: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(n)]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark options")
    group.add_argument("--model", default=None, help="a pooling model: a sentence-transformers folder or .zip "
                                                     "(required without --base-url)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="vlite's dtype (default: %(default)s)")
    group.add_argument("--num-sentences", type=positive_int, default=512, metavar="N", help="(default: %(default)s)")
    group.add_argument("--min-words", type=positive_int, default=10, metavar="N", help="(default: %(default)s)")
    group.add_argument("--max-words", type=positive_int, default=30, metavar="N", help="(default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                       help="vlite's step budget (default: %(default)s)")
    group.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="torch threads for both (default: torch's)")
    group.add_argument("--no-reference", action="store_true", help="skip sentence-transformers")
    group.add_argument("--base-url", default=None, metavar="URL",
                       help="measure a running server's /v1/embeddings latency instead, one sentence per request "
                            "(e.g. http://localhost:8000)")
    group.add_argument("--api-key", default=None, metavar="KEY", help="the server's key (default: $VLITE_API_KEY)")
    add_output_args(parser, profile=False)


def run_embed(model: str, texts: list[str], dtype: str = "auto", max_num_batched_tokens: int = 8192,
              threads: int | None = None, reference: bool = True) -> dict[str, Any]:
    import torch

    from vlite import LLM

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=1024)
    llm.embed(texts[:8], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {"model": model, "dtype": llm.llm_engine.model_config.dtype, "sentences": len(texts),
                              "tokens": sum(len(o.prompt_token_ids) for o in outs), "vlite_s": elapsed,
                              "vlite_sentences_per_s": len(texts) / elapsed, "threads": torch.get_num_threads()}
    if reference:
        from sentence_transformers import SentenceTransformer

        from vlite.model_loader import resolve_model

        st = SentenceTransformer(str(resolve_model(model).path), device="cpu")
        st.encode(texts[:8], batch_size=32)
        start = time.perf_counter()
        ref = st.encode(texts, batch_size=32, convert_to_tensor=True)
        result["st_s"] = time.perf_counter() - start
        result["st_sentences_per_s"] = len(texts) / result["st_s"]
        ours = torch.tensor([o.outputs.embedding for o in outs])
        result["min_cosine"] = float(torch.nn.functional.cosine_similarity(ours, ref.float()).min())
    return result


def run_server_latency(base_url: str, texts: list[str], api_key: str | None = None, warmup: int = 5
                       ) -> dict[str, Any]:
    """One /v1/embeddings request per text, one at a time: latency percentiles (ms) and the tokens of each."""
    import httpx
    import numpy as np

    from vlite.benchmarks.serve.client import api_key_from, headers_for

    latencies, tokens = [], []
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers_for(api_key_from(api_key)), timeout=60) as client:
        models = client.get("/v1/models")
        if models.status_code != 200:
            raise ValueError(f"{base_url}/v1/models answered {models.status_code}: {models.text[:200]}")
        model = models.json()["data"][0]["id"]
        for i, text in enumerate(texts[:warmup] + texts):
            start = time.perf_counter()
            r = client.post("/v1/embeddings", json={"model": model, "input": text})
            elapsed = time.perf_counter() - start
            if r.status_code != 200:
                raise ValueError(f"/v1/embeddings answered {r.status_code}: {r.text[:200]}")
            if i >= warmup:
                latencies.append(elapsed * 1000)
                tokens.append(r.json()["usage"]["prompt_tokens"])
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    return {"base_url": base_url, "model": model, "requests": len(latencies), "mean_tokens": float(np.mean(tokens)),
            "p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "mean_ms": float(np.mean(latencies))}


def main(ns: argparse.Namespace) -> int:
    texts = sentences(ns.num_sentences, ns.min_words, ns.max_words)
    if ns.base_url is not None:
        r = run_server_latency(ns.base_url, texts, ns.api_key)
        print(f"embed (server {r['base_url']}, {r['model']}): {r['requests']} requests of one sentence "
              f"({r['mean_tokens']:.1f} tokens on average), one at a time")
        print(f"latency ms: p50 {r['p50_ms']:.2f}  p90 {r['p90_ms']:.2f}  p99 {r['p99_ms']:.2f}  "
              f"mean {r['mean_ms']:.2f}")
        write_json(ns.output_json, {"args": jsonable_args(ns), **r})
        return 0
    if ns.model is None:
        raise ValueError("vlite bench embed needs --model: a pooling model (a sentence-transformers folder or .zip), "
                         "or --base-url: a running server")
    r = run_embed(ns.model, texts, ns.dtype, ns.max_num_batched_tokens, ns.threads, not ns.no_reference)
    print(f"embed: {r['sentences']} sentences, {r['tokens']} tokens, {r['threads']} threads, vlite {r['dtype']}")
    print(f"vlite                 {r['vlite_s']:7.2f} s  {r['vlite_sentences_per_s']:8.1f} sentences/s")
    if "st_s" in r:
        print(f"sentence-transformers {r['st_s']:7.2f} s  {r['st_sentences_per_s']:8.1f} sentences/s  "
              f"(vlite {r['vlite_sentences_per_s'] / r['st_sentences_per_s']:.2f}x; lowest cosine "
              f"{r['min_cosine']:.6f})")
    write_json(ns.output_json, {"args": jsonable_args(ns), **r})
    return 0
