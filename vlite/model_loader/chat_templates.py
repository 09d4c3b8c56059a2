"""Chat templates of model families whose GGUF files often carry none.

llama.cpp's converter copies `tokenizer.chat_template` only where the source repo's tokenizer_config.json
had one; files converted from a base checkpoint (gemma-3-270m) lack it although the family's turns are
fixed. Without a template a chat request could not be served at all, and a generic one (ChatML) would
spell turns with tokens the model never saw. A template in the file, or `--chat-template`, always wins.
"""

from __future__ import annotations

# Gemma 3's template (google/gemma-3-*-it, tokenizer_config.json): a system message is prefixed to the
# first user turn, the assistant is "model", every turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# GGUF general.architecture -> the template used when the file has none.
FAMILY_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
