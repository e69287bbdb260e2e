"""A released directory's chat template, in each form Qwen and NVIDIA ship it, is found and
rendered as transformers' `apply_chat_template` renders it: a `tokenizer_config.json`
string (Qwen3), a `chat_template.jinja` beside a config without one (Qwen3.5), and a list of
named templates with special tokens as added-token objects (NVIDIA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.text import TextModel
from models.model_files import ModelLoadError, load_chat_template
from tests.models.hf_fixtures import save_hf_model

# Qwen3's template: the reversed scan for the last query, thinking blocks, tools as JSON.
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# NVIDIA's form: named templates, the chat's `default`, the BOS token from the config.
NVIDIA_DEFAULT = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '<extra_id_0>System\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '<extra_id_1>User\\n' + message['content'] | trim + '\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<extra_id_1>Assistant\\n' + message['content'] | trim + '\\n' }}"
    "{%- else %}{{- raise_exception('Unknown role: ' + message['role']) }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<extra_id_1>Assistant\\n' }}{%- endif %}{{- eos_token if false }}"
)
NVIDIA_TOOLS = "{{- bos_token }}TOOLS {{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _added(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False}


FORMS = {
    "qwen3-tokenizer-config": (
        {"chat_template": QWEN, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        None,
    ),
    "qwen3_5-jinja-file": ({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN),
    "nvidia-named-templates": (
        {
            "chat_template": [
                {"name": "default", "template": NVIDIA_DEFAULT},
                {"name": "tool_use", "template": NVIDIA_TOOLS},
            ],
            "bos_token": _added("<s>"),
            "eos_token": _added("</s>"),
        },
        None,
    ),
}

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  t5 t6  "},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nt7"},
    {"role": "user", "content": "t8 ünïcode"},
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_hf_model("qwen3", path)
    return path


def _directory(base: Path, out: Path, tok_cfg: dict, jinja: str | None) -> Path:
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((base / name).read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tok_cfg}))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
def test_released_template_renders_as_transformers_does(base_dir, tmp_path, form):
    from transformers import AutoTokenizer

    path = _directory(base_dir, tmp_path / form, *FORMS[form])
    want = AutoTokenizer.from_pretrained(path).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert TextModel.load(str(path)).render_chat(CHAT) == want
    assert load_chat_template(path).template is not None


def test_named_templates_without_a_default_are_named(base_dir, tmp_path):
    tok_cfg = {"chat_template": [{"name": "rag", "template": "x"}, {"name": "tool_use", "template": "y"}]}
    path = _directory(base_dir, tmp_path / "m", tok_cfg, None)
    with pytest.raises(ModelLoadError, match="none named 'default'"):
        load_chat_template(path)
