"""Benchmark requests: random token-id prompts, input-grounded chat prompts, or a JSON file of them.

A request is a prompt as token ids plus the number of tokens to generate: exactly `output_len` for
random and JSON requests (`ignore_eos=True`); at most `output_len` for the "copy" ones, which end
where the model ends its answer.

"copy" (`copy_requests`): chat prompts whose answers repeat long spans of the prompt, the kind of
work n-gram speculative decoding is for: repeat a passage, correct its typos, or return a function
with one change (its name). Passages and functions come from Python's own standard library sources.

JSON dataset format (`--dataset-path`): a list of objects

    [{"prompt_token_ids": [1, 2, 3], "output_len": 16}, ...]
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    ignore_eos: bool = True  # False: at most output_len tokens, up to the model's end of answer

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Integer bounds of [(1 - r) * length, (1 + r) * length], at least 1."""
    if length < 1:
        raise ValueError(f"length must be at least 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.ceil((1.0 - range_ratio) * length - 1e-9))
    hi = max(lo, math.floor((1.0 + range_ratio) * length + 1e-9))
    return lo, hi


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int] = ()) -> list[int]:
    """Token ids a random prompt may use: the vocabulary without the special (and added) tokens."""
    special = set(int(i) for i in special_ids)
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError("no token ids left once the special tokens are excluded")
    return ids


def tokenizer_special_ids(tokenizer: Any) -> set[int]:
    """Special token ids and added tokens (e.g. <|im_start|>) of a Hugging Face tokenizer."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if get_added is not None:
        try:
            ids.update(get_added().values())
        except Exception:  # a tokenizer without added vocab support: the special ids are enough
            pass
    return ids


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, vocab_size: int = 32000, special_ids: Iterable[int] = (),
                    token_ids: Optional[Sequence[int]] = None, shared_prefix_len: int = 0) -> list[BenchRequest]:
    """`num_prompts` requests of random token ids, lengths uniform in the ranges of `length_range`.

    The same arguments give the same requests. `token_ids` (the ids to draw from) defaults to
    `allowed_token_ids(vocab_size, special_ids)`. `shared_prefix_len` > 0: every prompt starts with
    the same that many random tokens (a system prompt or document all requests share), before its own
    `input_len` ones (vLLM's random dataset `--random-prefix-len`).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    pool = list(token_ids) if token_ids is not None else allowed_token_ids(vocab_size, special_ids)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    if shared_prefix_len < 0:
        raise ValueError(f"shared_prefix_len must be at least 0, got {shared_prefix_len}")
    rng = random.Random(seed)
    prefix = [rng.choice(pool) for _ in range(shared_prefix_len)]
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(in_lo, in_hi)
        n_out = rng.randint(out_lo, out_hi)
        requests.append(BenchRequest(prefix + [rng.choice(pool) for _ in range(n_in)], n_out))
    return requests


def load_json_dataset(path: str, num_prompts: Optional[int] = None) -> list[BenchRequest]:
    """Requests from a JSON list of {"prompt_token_ids": [...], "output_len": n}; the first
    `num_prompts` of them when given (all by default)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read dataset {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"dataset {path!r} must be a non-empty JSON list of requests")
    requests = []
    for i, item in enumerate(data):
        where = f"dataset {path!r} entry {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where} is not an object")
        ids, out_len = item.get("prompt_token_ids"), item.get("output_len")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
            raise ValueError(f"{where}: output_len must be a positive integer, got {out_len!r}")
        requests.append(BenchRequest(list(ids), out_len))
    if num_prompts is not None:
        requests = requests[:num_prompts]
    return requests


def summarize(requests: Sequence[BenchRequest]) -> dict[str, int]:
    return {"num_requests": len(requests), "input_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.output_len for r in requests)}


_COPY_MODULES = ("textwrap", "json", "argparse", "collections", "functools", "pathlib", "shutil", "tempfile",
                 "logging", "csv", "heapq", "bisect", "fractions", "statistics", "string", "calendar")


def _passages_and_functions() -> tuple[list[str], list[str]]:
    """Prose passages (docstrings of 40-160 words) and short functions (5-25 lines) from the stdlib."""
    import importlib
    import inspect

    passages, functions = [], []
    for name in _COPY_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", None) != name:
                continue
            doc = " ".join((inspect.getdoc(obj) or "").split())
            if 40 <= len(doc.split()) <= 160:
                passages.append(doc)
            if inspect.isfunction(obj):
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 5 <= src.count("\n") <= 25 and src.lstrip().startswith("def "):
                    functions.append(src)
    return passages, functions


def _with_typos(text: str, rng: random.Random, n: int = 4) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), min(n, len(words))):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 1)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_requests(tokenizer: Any, num_prompts: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Chat prompts whose answers copy spans of the prompt (see the module docstring); the same
    arguments give the same requests."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    passages, functions = _passages_and_functions()
    rng = random.Random(seed)
    requests = []
    for i in range(num_prompts):
        kind = i % 3
        if kind == 0:
            text = f"Repeat the following text exactly, word for word:\n\n{rng.choice(passages)}"
        elif kind == 1:
            text = ("Correct the spelling mistakes in the following text and return the whole corrected text:"
                    f"\n\n{_with_typos(rng.choice(passages), rng)}")
        else:
            source = rng.choice(functions)
            name = source.split("def ", 1)[1].split("(", 1)[0]
            text = (f"Rename the function `{name}` to `{name}_v2` in this Python code and return the whole "
                    f"code:\n\n{source}")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = list(ids["input_ids"])
        requests.append(BenchRequest(list(ids), output_len, ignore_eos=False))
    return requests
