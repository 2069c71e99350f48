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
# With tools, as Qwen2.5's template (Hermes' format): the system turn lists them in <tools>
# and asks for each call as a <tool_call> block; an assistant turn's earlier calls are written
# back as such blocks, and tool results go in a user turn as <tool_response> blocks (one turn
# for consecutive results).
QWEN2_VL_CHAT_TEMPLATE = """
{%- macro render(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] in ('image', 'image_url') -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] in ('video', 'video_url') -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system' + '\\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- render(messages[0]['content']) -}}
    {%- else -%}
        {{- 'You are a helpful assistant.' -}}
    {%- endif -%}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' -}}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": ' -}}
    {{- '<args-json-object>}\\n</tool_call><|im_end|>' + '\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] not in ('system', 'user', 'assistant', 'tool') -%}
        {{- raise_exception('unsupported role: ' + message['role']) -}}
    {%- endif -%}
    {%- if loop.first and message['role'] == 'system' and tools -%}
        {#- written in the tools' system turn above -#}
    {%- elif message['role'] == 'tool' -%}
        {%- if loop.first or loop.previtem['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem['role'] != 'tool' -%}
            {{- '<|im_end|>' + '\\n' -}}
        {%- endif -%}
    {%- else -%}
        {%- if loop.first and message['role'] != 'system' and not tools -%}
            {{- '<|im_start|>system' + '\\n' + 'You are a helpful assistant.<|im_end|>' + '\\n' -}}
        {%- endif -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) -}}
        {%- for call in message['tool_calls'] or [] -%}
            {%- if loop.first and message['content'] -%}
                {{- '\\n' -}}
            {%- endif -%}
            {%- set call = call['function'] if call['function'] is defined else call -%}
            {{- '<tool_call>\\n{\\"name\\": \\"' + call['name'] + '\\", \\"arguments\\": ' -}}
            {{- (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + '}\\n</tool_call>' -}}
            {%- if not loop.last -%}
                {{- '\\n' -}}
            {%- endif -%}
        {%- endfor -%}
        {{- '<|im_end|>' + '\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant' + '\\n' -}}
{%- endif -%}
"""
