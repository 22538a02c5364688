"""Chat formats of real model families for tiny local tokenizers: the template (Jinja, written here in each family's
format) and the special tokens it writes, which the tiny tokenizer adds as real tokens.

- ``qwen2.5``: ``<|im_start|>system\\nS<|im_end|>\\n<|im_start|>user\\nU<|im_end|>\\n`` then the generation
  prompt ``<|im_start|>assistant\\n``; without a system turn the default one (``You are Qwen, created by Alibaba
  Cloud. ...``) is written.
- ``qwen3``: the same turns, no default system turn; ``enable_thinking=False`` appends ``<think>\\n\\n</think>\\n\\n``
  after the generation prompt.
- ``llama3``: ``<|begin_of_text|>``, then ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`` per turn
  (content trimmed), then ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``.

EOS is the end-of-turn token (``<|im_end|>``, ``<|eot_id|>``), as in the families' instruct tokenizers, so a sampled
answer stops at the end of its turn.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CHAT_FORMATS", "ChatFormat"]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """template: the Jinja chat template; special: the added special tokens (pad, eos and bos among them)."""

    template: str
    special: tuple[str, ...]
    pad: str
    eos: str
    bos: str | None = None


_IM_TURNS = ("{%- for m in messages -%}"
             "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{%- endfor -%}")
_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN25_TEMPLATE = ("{%- if messages[0]['role'] != 'system' -%}"
                   "{{ '<|im_start|>system\\n" + _QWEN25_SYSTEM + "<|im_end|>\\n' }}"
                   "{%- endif -%}" + _IM_TURNS +
                   "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")

QWEN3_TEMPLATE = (_IM_TURNS +
                  "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
                  "{%- if enable_thinking is defined and enable_thinking is false -%}"
                  "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}")

LLAMA3_TEMPLATE = ("{{- bos_token -}}"
                   "{%- for m in messages -%}"
                   "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
                   "'<|eot_id|>' }}"
                   "{%- endfor -%}"
                   "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
                   "{%- endif -%}")

_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# family -> its template and special tokens
CHAT_FORMATS: dict[str, ChatFormat] = {
    "qwen2.5": ChatFormat(QWEN25_TEMPLATE, _QWEN_SPECIAL, pad="<|endoftext|>", eos="<|im_end|>"),
    "qwen3": ChatFormat(QWEN3_TEMPLATE, _QWEN_SPECIAL + ("<think>", "</think>"), pad="<|endoftext|>",
                        eos="<|im_end|>"),
    "llama3": ChatFormat(LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                           "<|end_header_id|>", "<|eot_id|>"),
                         pad="<|end_of_text|>", eos="<|eot_id|>", bos="<|begin_of_text|>"),
}
