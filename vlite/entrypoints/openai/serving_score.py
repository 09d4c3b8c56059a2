"""vLLM's /score (text_1 against each text_2, 1:N or N:N) and /rerank (Jina's and Cohere's shape).

A cross-encoder (a classifier, runner "pooling") reads each pair as one input, its two segments told apart by
token types; an embedding model scores a pair by the cosine of the two embeddings, each text embedded once (as
vLLM and LLM.score do).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from vlite.entrypoints.openai.protocol import RerankDocument, RerankRequest, ScoreRequest
from vlite.entrypoints.openai.serving_embedding import OpenAIServingPooling, usage
from vlite.entrypoints.openai.serving_engine import OpenAIError


class OpenAIServingScore(OpenAIServingPooling):
    async def create_score(self, request: ScoreRequest) -> dict[str, Any]:
        model = self.check_pooling(request.model)
        first = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        second = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts:
                raise OpenAIError(f"{name} must not be empty (an empty list)", 400, name)
        if len(first) != 1 and len(first) != len(second):
            raise OpenAIError(f"text_1 must be one text, or as many as text_2 ({len(second)}); got {len(first)}", 400,
                              "text_1")
        scores, tokens = await self._scores(first, second, ("text_1", "text_2"), request)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], "usage": tokens}

    async def create_rerank(self, request: RerankRequest) -> dict[str, Any]:
        model = self.check_pooling(request.model)
        docs = [d.text if isinstance(d, RerankDocument) else d for d in request.documents]
        if not docs:
            raise OpenAIError("documents must not be empty (an empty list)", 400, "documents")
        scores, tokens = await self._scores([request.query], docs, ("query", "documents"), request)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:request.top_n or len(docs)]
        results = [{"index": i, **({"document": {"text": docs[i]}} if request.return_documents else {}),
                    "relevance_score": scores[i]} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": tokens, "results": results}

    async def _scores(self, first: list[str], second: list[str], fields: tuple[str, str],
                      request: Any) -> tuple[list[float], dict[str, int]]:
        """The score of (first[i], second[i]) for each i (a single first text against every second one) and the
        usage; `fields` name the request's two fields in errors."""
        for name, texts in zip(fields, (first, second)):
            for i, text in enumerate(texts):
                if not text:
                    raise OpenAIError(f"{_label(name, i, texts)} must not be an empty string", 400, name)
        config = self.engine.pooler_config
        truncate = request.truncate_prompt_tokens
        if config is not None and config.task == "classify":  # a cross-encoder: each pair one input
            params = self.pooling_params(truncate_prompt_tokens=truncate, activation=request.activation, task="score")
            pairs = [(_label(fields[1], i, second), {"prompt": first[0] if len(first) == 1 else first[i],
                                                     "prompt_pair": text}) for i, text in enumerate(second)]
            outs = await self.run(pairs, params, request.priority, "score")
            return [float(o.outputs.data[0]) for o in outs], usage(outs)
        params = self.pooling_params(truncate_prompt_tokens=truncate, task="embed")
        inputs = [(_label(name, i, texts), t) for name, texts in zip(fields, (first, second))
                  for i, t in enumerate(texts)]
        outs = await self.run(inputs, params, request.priority, "score")
        left, right = outs[:len(first)], outs[len(first):]
        scores = [_cosine(left[0 if len(left) == 1 else i].outputs.data, r.outputs.data) for i, r in enumerate(right)]
        return scores, usage(outs)


def _label(field: str, index: int, texts: list[str]) -> str:
    return field if len(texts) == 1 else f"{field}[{index}]"


def _cosine(a: list[float], b: list[float]) -> float:
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norm if norm > 0 else 0.0

