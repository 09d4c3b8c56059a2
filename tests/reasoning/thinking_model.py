"""A tiny "thinking" model whose greedy output is known: a Qwen3 of one layer whose attention and MLP write
nothing, one-hot embeddings, and an lm_head that scores each token's successors 3, 2, 1 (primary,
secondary, tertiary). Greedy decoding then follows a chain fixed by the prompt's last token; a logit
bias or a grammar that rules out the primary successor takes the next one. Its tokenizer is byte-level
with the chain's pieces as added tokens (as Qwen3's <think> and </think> are: added, not special).

From the plain generation prompt (last token "\\n"):
    <think> \\nPonder <tool_call>{decoy}</tool_call> deeply.</think>
        \\n\\n Paris it is. <|im_end|>                        (primary: a text answer)
        <tool_call>{get_weather Paris}</tool_call><|im_end|>   (secondary: a Hermes tool call)
        [{"name": "get_weather", "parameters": {"city": "Paris"}}]  (tertiary: JSON, as a grammar takes it)
Qwen3's template with enable_thinking false ends in "</think>\\n\\n": the text answer alone. R1's template ends in
"<｜Assistant｜><think>\\n" (one token here): "Weigh it</think>", then the same answers. A prompt ending in
<|split|> writes tags split across tokens: "<thi" "nk>" "Split here" "</t" "hink>" " after answer".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DECOY = ' <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
JSON_1, JSON_2 = '[{"name": "get_weather"', ', "parameters": {"city": "Paris"}}]'
R1_OPEN = "<｜Assistant｜><think>\n"
EOS = "<|im_end|>"
# token -> its successors, most likely first
CHAINS: dict[str, list[str]] = {
    "\n": ["<think>"], "<think>": ["\nPonder"], "\nPonder": [DECOY], DECOY: [" deeply."], " deeply.": ["</think>"],
    "</think>": ["\n\n", "<tool_call>", JSON_1], "\n\n": ["Paris", JSON_1], "Paris": [" it is"], " it is": ["."],
    ".": [EOS], "<tool_call>": [CALL], CALL: ["</tool_call>"], "</tool_call>": [EOS], JSON_1: [JSON_2], JSON_2: [EOS],
    R1_OPEN: ["Weigh"], "Weigh": [" it"], " it": ["</think>"],
    "<|split|>": ["<thi"], "<thi": ["nk>"], "nk>": ["Split here"], "Split here": ["</t"], "</t": ["hink>"],
    "hink>": [" after answer"], " after answer": [EOS],
}
ANSWER = "\n\nParis it is."
REASONING = "\nPonder" + DECOY + " deeply."

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
               "{% else %}<｜Assistant｜>{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
SPLIT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|split|>"


def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", EOS]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>",
                                   chat_template=QWEN3_TEMPLATE)
    words = sorted({w for k, v in CHAINS.items() for w in [k, *v]} - set(specials) - {"\n", "."})
    fast.add_tokens(words)
    return fast


def build(folder: Path) -> Path:
    """Write the model and its tokenizer to `folder` (a Hugging Face folder vlite loads)."""
    tok = tokenizer()
    return write_chain_model(folder, tok, CHAINS, tok.convert_tokens_to_ids(EOS), max_position_embeddings=512)


def write_chain_model(folder: Path, tok: Any, chains: dict[str, list[str]], eos_token_id: int,
                      max_position_embeddings: int) -> Path:
    """One Qwen3 layer whose attention and MLP write nothing, one-hot embeddings, an lm_head scoring each token's
    successors in `chains` 3, 2, 1: greedy output follows the chain of the last token. Saved with `tok`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = (len(tok) + 31) // 32 * 32  # hidden size = vocabulary: the embeddings are one-hot
    config = Qwen3Config(vocab_size=size, hidden_size=size, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                         eos_token_id=eos_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the residual stream stays the token's own embedding
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        head = torch.zeros(size, size)
        for token, successors in chains.items():
            for rank, nxt in enumerate(successors):
                head[token_id(tok, nxt), token_id(tok, token)] = 3.0 - rank
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def token_id(tok: Any, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]
