"""/v1/completions: a prompt (or a batch of them) in, a text_completion response or its SSE stream out."""

from __future__ import annotations

import uuid
from itertools import islice
from typing import Any, AsyncIterator, Optional

from vlite.entrypoints.openai.protocol import CompletionRequest
from vlite.entrypoints.openai.serving_engine import (ChoiceState, OpenAIError, OpenAIServing, Prepared, Usage,
                                                     finite_logprob)
from vlite.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Any:
        model, lora_request = self.resolve_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (it must equal n)", 400, "best_of")
        prompts = await self.run_tokenizer(self._completion_prompts, request.prompt)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        prepared = [self._prepare(text, ids, request, f"{base_id}-{i}", request.max_tokens, "prompt", request.echo,
                                  lora_request) for i, (text, ids) in enumerate(prompts)]
        echo = await self.run_tokenizer(self._echo_texts, prompts, prepared) if request.echo else None
        if request.stream:
            await self._start_constrained(prepared)
            usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prepared))
            return self._stream(self._completion_chunks(request, prepared, usage, echo), base_id, "text_completion",
                                model, usage, request.stream_options)
        return self._completion_full(request, prepared, base_id, model, echo)  # awaited by the route

    def _echo_texts(self, prompts: list[tuple[Optional[str], list[int]]], prepared: list[Prepared]) -> list[str]:
        """What each choice's text starts with under echo: the prompt as sent, or its tokens decoded
        (a prompt of token ids, or one cut by truncate_prompt_tokens)."""
        return [text if text is not None and len(ids) == len(p.token_ids) else self.tokenizer.decode(p.token_ids)
                for (text, ids), p in zip(prompts, prepared)]

    def _completion_prompts(self, prompt: Any) -> list[tuple[Optional[str], list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", 400, "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("prompt must not be empty", 400, "prompt")
                out.append((p, self.tokenizer.encode(p)))
            else:
                if not p:
                    raise OpenAIError("prompt must not be empty", 400, "prompt")
                out.append((None, list(p)))
        return out

    async def _completion_full(self, request: CompletionRequest, prepared: list[Prepared], base_id: str,
                               model: str, echo: Optional[list[str]]) -> dict[str, Any]:
        finals = await self._final_outputs(prepared)
        choices, usage = [], Usage()
        for i, p in enumerate(prepared):
            out = finals[i]
            usage.prompt_tokens += len(p.token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                index = i * request.n + c.index
                usage.choices[index] = ChoiceState(completion_tokens=len(c.token_ids))
                prefix = echo[i] if echo is not None else None
                choices.append({"index": index, "text": (prefix or "") + c.text,
                                "logprobs": self._choice_logprobs(request, p, out, c, prefix, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return self._response(base_id, "text_completion", model, choices, usage)

    async def _completion_chunks(self, request: CompletionRequest, prepared: list[Prepared], usage: Usage,
                                 echo: Optional[list[str]]) -> AsyncIterator[list[dict[str, Any]]]:
        """The choices of each stream chunk (see OpenAIServing._stream), counting tokens into `usage`."""
        async for i, out in self._generate_all(prepared):
            for c in out.outputs:
                index = i * request.n + c.index
                state = usage.choices.setdefault(index, ChoiceState())
                state.completion_tokens += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue  # e.g. a chunk of the prompt computed (its logprobs wait for the echo)
                # Under echo, a choice's first chunk starts with the prompt (and its logprobs).
                prefix = echo[i] if echo is not None and not state.echoed else None
                state.echoed = True
                logprobs = self._choice_logprobs(request, prepared[i], out, c, prefix, state.text_offset)
                text = (prefix or "") + c.text
                state.text_offset += len(text)
                yield [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason}]

    def _choice_logprobs(self, request: CompletionRequest, p: Prepared, out: RequestOutput, c: CompletionOutput,
                         prefix: Optional[str], text_offset: int) -> Optional[dict[str, Any]]:
        """A choice's (or a stream chunk's) logprobs object; with `prefix` (the echoed prompt, which
        starts at text_offset) the prompt's tokens come first and the generated ones after it."""
        if request.logprobs is None:
            return None
        n = request.logprobs
        if prefix is None:
            return self._completion_logprobs(c.token_ids, c.logprobs or [], n, text_offset)
        prompt_logprobs = out.prompt_logprobs or []
        if len(prompt_logprobs) != len(p.token_ids):
            raise OpenAIError(f"the engine returned logprobs for {len(prompt_logprobs)} of the prompt's "
                              f"{len(p.token_ids)} tokens", 500)
        head = self._completion_logprobs(p.token_ids, prompt_logprobs, n, text_offset)
        tail = self._completion_logprobs(c.token_ids, c.logprobs or [], n, text_offset + len(prefix))
        return {key: head[key] + tail[key] for key in head}

    def _completion_logprobs(self, token_ids: list[int], positions: list[Optional[dict[int, Logprob]]], n: int,
                             text_offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object: per token its text, logprob, the top n at its position (with
        the token itself) and where its text starts. A prompt's first token has no logprobs: nulls."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for token_id, position in zip(token_ids, positions):
            if position is None:
                text = self.tokenizer.decode([token_id])
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = position.get(token_id) or Logprob(float("-inf"))
                text = self._tok(token_id, chosen)
                token_logprobs.append(finite_logprob(chosen.logprob))
                top_logprobs.append({self._tok(t, lp): finite_logprob(lp.logprob)
                                     for t, lp in islice(position.items(), n + 1)})
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
