"""Sampling parameters with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
import math
import json as _json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

_SAMPLING_EPS = 1e-5
# The runner keeps sampling parameters in float32 arrays: larger finite doubles would become inf there.
_FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streaming request carries."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    """An int that fits the engine's int64 arrays (bool is not an int here)."""
    return isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63


def _as_list(value: object, name: str) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be a list, got {value!r}")


# JSON Schema keywords xgrammar compiles but does not enforce (measured on xgrammar 0.2.9: an instance breaking
# each one completes the grammar): refused up front, as vLLM refuses schemas its xgrammar backend cannot follow.
_UNENFORCED_KEYWORDS = frozenset({"uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then",
                                  "else", "dependentRequired", "dependentSchemas", "dependencies"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")  # a schema or a list of schemas
_SCHEMA_VALUES = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                  "propertyNames", "contains", "not", "if", "then", "else")


def _unenforced_keywords(schema: Any, path: str = "") -> list[str]:
    """'keyword at path' for every unenforced keyword in a schema, following only the keywords whose
    values are schemas (a property named "not" is no keyword; enum / const / default values are data)."""
    if not isinstance(schema, dict):
        return []
    here = path.rstrip(".") or "the root"
    found = [f"{k} at {here}" for k in sorted(_UNENFORCED_KEYWORDS & schema.keys())]
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found += _unenforced_keywords(sub, f"{path}{key}.{name}.")
        elif key in _SCHEMA_LISTS:
            for i, sub in enumerate(value if isinstance(value, list) else [value]):
                found += _unenforced_keywords(sub, f"{path}{key}.{i}." if isinstance(value, list) else
                                              f"{path}{key}.")
        elif key in _SCHEMA_VALUES:
            found += _unenforced_keywords(value, f"{path}{key}.")
    return found


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of `json` (a JSON schema, as a dict
    or a JSON string), `regex`, `choice` (one of these strings), `grammar` (EBNF / GBNF) or
    `json_object=True` (any JSON object). `disable_any_whitespace` makes JSON compact (no free
    whitespace between tokens). Compiled by xgrammar (`pip install vlite[structured]`)."""

    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {kinds or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(parsed).__name__}")
            unenforced = _unenforced_keywords(parsed)
            if unenforced:
                raise ValueError("structured_outputs.json uses JSON Schema keywords the grammar backend does not "
                                 f"enforce (output could break them): {', '.join(unenforced)}; unsupported: "
                                 f"{', '.join(sorted(_UNENFORCED_KEYWORDS))}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint: the compiled-grammar cache key."""
        kind = self.kind
        value = getattr(self, kind) if kind != "json_object" else True
        if not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True)
        return kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the field.

    `top_k` 0 or -1 disables top-k; `temperature` 0 means greedy. `max_tokens` 0 (with
    `prompt_logprobs`) computes the prompt and its logprobs, samples nothing, and finishes "length".
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # With a reasoning parser: the most tokens the thinking block may hold, after which its end tag is forced
    # (vLLM's name; None: unlimited, 0: no thinking). Structured outputs then constrain the answer after it.
    thinking_token_budget: Optional[int] = None
    # Filled by the input processor: token ids of bad_words as the model would emit them.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else _as_list(self.stop, "stop")
        self.stop_token_ids = [] if self.stop_token_ids is None else _as_list(self.stop_token_ids, "stop_token_ids")
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None:
                setattr(self, name, _as_list(getattr(self, name), name))
        if self.logit_bias is not None:
            # JSON clients send string keys.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from e
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters are meaningless, normalise them so batching stays on the fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0

    def _verify(self) -> None:
        def check(ok: bool, name: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                     "min_p"):
            value = getattr(self, name)
            check(_is_number(value) and math.isfinite(value) and abs(value) <= _FLOAT32_MAX, name,
                  "a finite number within float32 range")
        for name in ("n", "top_k", "min_tokens"):
            check(_is_int(getattr(self, name)), name, "a 64-bit integer")
        check(self.n >= 1, "n", "at least 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "greater than 0")
        check(self.temperature >= 0.0, "temperature", "non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(self.top_k >= -1, "top_k", "-1, 0 (disabled) or a positive integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        if self.max_tokens is not None:
            # 0 scores the prompt without generating (echo with max_tokens=0 on the server): only
            # meaningful with prompt_logprobs, so only allowed with them.
            least = 0 if self.prompt_logprobs is not None else 1
            check(_is_int(self.max_tokens) and self.max_tokens >= least, "max_tokens",
                  "a 64-bit integer, at least 1 (0 only with prompt_logprobs: score the prompt, generate nothing)")
        check(self.min_tokens >= 0, "min_tokens", "non-negative")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check(_is_int(value) and value >= -1, name, "-1 (whole vocabulary) or a non-negative integer")
        if self.seed is not None:
            check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and -2**63 <= self.seed < 2**64,
                  "seed", "an integer in [-2^63, 2^64)")
        if self.truncate_prompt_tokens is not None:
            check(_is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens >= 1,
                  "truncate_prompt_tokens", "at least 1")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "a list of non-negative token ids")
        if self.allowed_token_ids is not None:
            check(len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                  "allowed_token_ids", "a non-empty list of non-negative token ids")
        if self.logit_bias is not None:
            check(all(0 <= k < 2**63 and math.isfinite(v) for k, v in self.logit_bias.items()), "logit_bias",
                  "a map from non-negative token ids to finite numbers")
        if self.bad_words is not None:
            check(all(isinstance(w, str) and w for w in self.bad_words), "bad_words", "a list of non-empty strings")
        if self.thinking_token_budget is not None:
            check(_is_int(self.thinking_token_budget) and self.thinking_token_budget >= 0, "thinking_token_budget",
                  "None (unlimited) or a non-negative integer (0: no thinking)")
        check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "a StructuredOutputsParams")

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or [])

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
