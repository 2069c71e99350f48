"""The chat templates of the checkpoints ``hydrad make-model`` writes, one per conversation format.

Every tag strips the whitespace around it, so the layout below is free; newlines in the
output are expressions (``'\\n'``), which survive the ``trim_blocks`` rendering.
"""

# Images before the text of a turn, one "<image>\n" each, as in LLaVA's training data.
_LLAVA_RENDER = """
{%- macro render(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content if part['type'] in ('image', 'image_url') -%}
            {{- '<image>' + '\\n' -}}
        {%- endfor -%}
        {%- for part in content if part['type'] == 'text' -%}
            {{- (' ' if not loop.first else '') + part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

# LLaVA-1.5's conversation format (vicuna_v1): "[system ]USER: <image>\n<text> ASSISTANT: <reply></s>".
LLAVA_CHAT_TEMPLATE = _LLAVA_RENDER + """
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {{- render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'user' -%}
        {{- 'USER: ' + render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + render(message['content']) + '</s>' -}}
    {%- else -%}
        {{- raise_exception('unsupported role: ' + message['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""

# llava-v1.6-mistral's format: "[system\n\n][INST] <image>\n<text> [/INST] <reply></s>"; the
# closing [/INST] is already the generation prompt.
MISTRAL_CHAT_TEMPLATE = _LLAVA_RENDER + """
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {{- render(message['content']) + '\\n\\n' -}}
    {%- elif message['role'] == 'user' -%}
        {{- '[INST] ' + render(message['content']) + ' [/INST]' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- ' ' + render(message['content']) + '</s>' -}}
    {%- else -%}
        {{- raise_exception('unsupported role: ' + message['role']) -}}
    {%- endif -%}
{%- endfor -%}
"""

# Qwen2-VL's ChatML format: images and videos stay where they are in the turn, each wrapped in
# <|vision_start|> ... <|vision_end|>; a default system turn comes first unless one is given.
QWEN2_VL_CHAT_TEMPLATE = """
{%- for message in messages -%}
    {%- if loop.first and message['role'] != 'system' -%}
        {{- '<|im_start|>system' + '\\n' + 'You are a helpful assistant.<|im_end|>' + '\\n' -}}
    {%- endif -%}
    {%- if message['role'] not in ('system', 'user', 'assistant') -%}
        {{- raise_exception('unsupported role: ' + message['role']) -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] in ('image', 'image_url') -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] in ('video', 'video_url') -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>' + '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant' + '\\n' -}}
{%- endif -%}
"""
