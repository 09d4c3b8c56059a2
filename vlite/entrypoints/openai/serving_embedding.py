"""OpenAI's /v1/embeddings (vLLM's extras: truncate_prompt_tokens, normalize) and vLLM's /pooling.

Each input is one engine request; every input is validated and tokenized first (a 400 naming the field and
its limit, before any work), then all run concurrently (the engine batches them). `OpenAIServingPooling` is
what these and /score, /rerank (serving_score.py) share.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any, Callable, Optional

from vlite.entrypoints.openai.protocol import EmbeddingRequest, PoolingRequest
from vlite.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, _field_of
from vlite.outputs import PoolingRequestOutput
from vlite.pooling_params import PoolingParams

# Request fields that become PoolingParams: an error naming one of them is that field's.
_PARAM_FIELDS = ("dimensions", "normalize", "activation", "truncate_prompt_tokens")


class OpenAIServingPooling(OpenAIServing):
    """The pooling routes' base: the runner check, the pooling parameters, inputs checked up front."""

    def check_pooling(self, model: Optional[str]) -> str:
        name, lora_request = self.resolve_model(model)
        if lora_request is not None:
            raise OpenAIError(f"`{name}` is a LoRA adapter: adapters serve generation (/v1/completions, "
                              "/v1/chat/completions), not embeddings or scores; name the base model", 400, "model")
        self.check_runner("pooling")
        return name

    @staticmethod
    def pooling_params(**fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as e:
            raise OpenAIError(str(e), 400, _field_of(str(e))) from None

    async def run(self, inputs: list[tuple[str, Any]], params: PoolingParams, priority: int,
                  prefix: str) -> list[PoolingRequestOutput]:
        """Each (field, prompt) validated and tokenized on the tokenizer thread (a 400 naming the first bad one's
        field), then all run as concurrent engine requests; their outputs in input order."""
        base_id = f"{prefix}-{uuid.uuid4().hex}"

        def prepare() -> list[Any]:
            prepared = []
            encoded = self.engine.tokenize_pooling_texts([p for _, p in inputs], [params] * len(inputs))
            for i, ((label, prompt), ids) in enumerate(zip(inputs, encoded)):
                try:
                    prepared.append(self.engine.process_pooling_inputs(f"{base_id}-{i}", prompt, params, priority,
                                                                       encoded=ids))
                except ValueError as e:
                    raise _input_error(str(e), label, params) from None
            return prepared

        tasks = [asyncio.ensure_future(self.engine.encode(p)) for p in await self.run_tokenizer(prepare)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed or the client left: the others are aborted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServingEmbedding(OpenAIServingPooling):
    async def create_embedding(self, request: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings response: one {"object": "embedding", "index", "embedding"} per input."""
        return await self._pooled(request, "embd", "embedding", "embedding",
                                  dict(dimensions=request.dimensions, task="embed"))

    async def create_pooling(self, request: PoolingRequest) -> dict[str, Any]:
        """vLLM's pooling response: the model's own output of each input ({"object": "pooling", "index", "data"})."""
        return await self._pooled(request, "pool", "pooling", "data",
                                  dict(dimensions=request.dimensions, activation=request.activation))

    async def _pooled(self, request: EmbeddingRequest, prefix: str, object_name: str, key: str,
                      fields: dict[str, Any]) -> dict[str, Any]:
        model = self.check_pooling(request.model)
        params = self.pooling_params(normalize=request.normalize, truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     **fields)
        inputs = input_list(request.input, "input")
        outs = await self.run(inputs, params, request.priority, prefix)
        encode: Callable[[list[float]], Any] = to_base64 if request.encoding_format == "base64" else list
        data = [{"index": i, "object": object_name, key: encode(o.outputs.data)} for i, o in enumerate(outs)]
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": usage(outs)}


def input_list(value: Any, field: str) -> list[tuple[str, Any]]:
    """A request's input (a text, texts, token ids or lists of them) as (field label, prompt) pairs."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [(field, value)]
    if not value:
        raise OpenAIError(f"{field} must not be empty (an empty list)", 400, field)
    return [(f"{field}[{i}]", v) for i, v in enumerate(value)]


def usage(outs: list[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def to_base64(values: list[float]) -> str:
    """Little-endian float32 bytes in base64, as OpenAI's client decodes them (numpy.frombuffer, float32)."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def _input_error(message: str, label: str, params: PoolingParams) -> OpenAIError:
    """An input refused by the InputProcessor: its field, or the pooling parameter the message names."""
    head = _field_of(message)
    if head in _PARAM_FIELDS:
        return OpenAIError(message, 400, head)
    if head == "task":  # e.g. embeddings from a cross-encoder
        return OpenAIError(f"{message} (this model's pooling task does not serve this route)", 400, "model")
    if "tokens long" in message and params.truncate_prompt_tokens is None:
        message += "; set truncate_prompt_tokens to truncate it"
    return OpenAIError(f"{label}: {message}", 400, label.split("[", 1)[0])
