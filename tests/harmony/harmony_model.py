"""A tokenizer with harmony's special tokens, and a tiny model that answers in harmony (as gpt-oss does).

The tokenizer is byte-level with <|start|> <|end|> <|message|> <|channel|> <|constrain|> <|return|> <|call|>
as special tokens (o200k_harmony is not available offline). The model is the thinking model's construction
(tests/reasoning/thinking_model.py): one Qwen3 layer whose attention and MLP write nothing, one-hot
embeddings, an lm_head scoring each token's successors 3, 2, 1. Its greedy output follows a chain fixed by
the last token; harmony repeats <|channel|> and <|message|> in every message, so which message it writes
is chosen per request with logit_bias against the higher-ranked successors. From a harmony prompt (last
token "assistant"):
    no bias:                         <|channel|>analysis<|message|>Weigh it.<|end|><|start|>assistant ... (again)
    bias against analysis, Weigh it: <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
                                     {"city": "Paris"}<|call|>
    ... and against the call too:    <|channel|>final<|message|>Sunny in Paris.<|return|>
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.reasoning.thinking_model import token_id, write_chain_model

HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
EOS = "<|endoftext|>"
RECIPIENT = "commentary to=functions.get_weather "
ARGS = '{"city": "Paris"}'
CHAINS: dict[str, list[str]] = {
    "assistant": ["<|channel|>"],
    "<|channel|>": ["analysis", RECIPIENT, "final"],
    "analysis": ["<|message|>"], "final": ["<|message|>"], RECIPIENT: ["<|constrain|>"],
    "<|constrain|>": ["json"], "json": ["<|message|>"],
    "<|message|>": ["Weigh it.", ARGS, "Sunny in Paris."],
    "Weigh it.": ["<|end|>"], "<|end|>": ["<|start|>"], "<|start|>": ["assistant"],
    ARGS: ["<|call|>"], "Sunny in Paris.": ["<|return|>"],
}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS] + HARMONY
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.add_tokens(sorted({w for k, v in CHAINS.items() for w in [k, *v]} - set(specials)))
    return fast


def build(folder: Path) -> Path:
    """Write the model and its tokenizer to `folder` (a Hugging Face folder vlite loads)."""
    tok = tokenizer()
    return write_chain_model(folder, tok, CHAINS, token_id(tok, EOS), max_position_embeddings=2048)
