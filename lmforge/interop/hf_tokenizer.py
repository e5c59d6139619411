"""The tokenizer half of an HF export: ``tokenizer.json`` and its config files, and the Jinja chat template.

``tokenizer.json`` is the tokenizer stage's own HF document (:func:`lmforge.tokenizer.formats.hf_tokenizer_dict`:
Split(lmforge's regex) + ByteLevel, the BPE vocab and merges, every special token as an added token), so
``AutoTokenizer`` gives lmforge's ids, special tokens in text included (lmforge's ``special="allowed"``).

The BOS: the export adds a post-processor that starts every encoded text with the end-of-text token, and names
it ``bos_token`` (``add_bos_token: true``). lmforge conditions every scored context on it
(:func:`lmforge.evals.loglik.encode_request`) and every pretraining document starts right after it, so HF tools
with their defaults (``lm_eval --model hf --model_args pretrained=DIR``, ``tokenizer(text)`` then ``generate``)
see what lmforge's model saw; ``encode(text, add_special_tokens=False)`` gives ``Tokenizer.encode(text)``.
``apply_chat_template`` tokenizes without special tokens added, and its template starts with that token itself.

The chat template is generated from the chat format's own token constants
(:data:`lmforge.chat.format.CHAT_SPECIAL_TOKENS`) and held to :class:`lmforge.chat.format.ChatFormat` by
tests: ``apply_chat_template(messages, tokenize=True)`` gives ``ChatFormat.render(messages)[0]``, and with
``add_generation_prompt=True`` ``ChatFormat.render_for_completion(messages)``. Messages are lmforge's: roles
``system``/``user``/``assistant``/``tool``, an assistant's calculator call in ``"tool_call": "EXPR"``, and
function tools as ``apply_chat_template(messages, tools=[...])`` passes them, with OpenAI-shaped ``tool_calls``.

One difference no template can remove: ``apply_chat_template`` renders text and then tokenizes it, so a
message whose *text* holds a special token string (``<|user_end|>``) gets the special id there, while
lmforge's renderer encodes message text with ``special="plain"``. Every HF chat model shares this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.chat.format import CHAT_SPECIAL_TOKENS, TOOL_SPECIAL_TOKENS
from lmforge.common import atomic_write_text
from lmforge.tokenizer import EOT, Tokenizer
from lmforge.tokenizer.formats import hf_tokenizer_dict

__all__ = ["bos_post_processor", "chat_template", "has_chat_tokens", "write_hf_tokenizer", "stop_token_ids"]

# The chat format's tokens, in the order CHAT_SPECIAL_TOKENS lists them (its docstring promises that order;
# new tokens are appended, so the first eleven keep their meaning).
(_BEGIN, _SYSTEM_START, _SYSTEM_END, _USER_START, _USER_END, _ASSISTANT_START, _ASSISTANT_END,
 _PYTHON_START, _PYTHON_END, _OUTPUT_START, _OUTPUT_END) = CHAT_SPECIAL_TOKENS[:11]
_TOOLS_START, _TOOLS_END, _CALL_START, _CALL_END = TOOL_SPECIAL_TOKENS


def has_chat_tokens(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` holds every chat special token (then the export carries a chat template)."""
    return all(t in tokenizer.special_tokens for t in CHAT_SPECIAL_TOKENS)


def stop_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids where generation ends: the end-of-text token, and ``<|assistant_end|>`` when the chat tokens exist."""
    sp = tokenizer.special_tokens
    return [sp[t] for t in (EOT, _ASSISTANT_END) if t in sp]


def bos_post_processor(eot_id: int) -> dict[str, Any]:
    """``tokenizer.json``'s post-processor that starts every encoded text with the end-of-text token (lmforge's
    BOS: every pretraining document starts right after it, and evals condition every context on it)."""
    bos = {"SpecialToken": {"id": EOT, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOT, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {EOT: {"id": EOT, "ids": [eot_id], "tokens": [EOT]}}}


def _lit(s: str) -> str:
    """A Jinja string literal of ``s`` (JSON escaping is valid Jinja for these ASCII token strings)."""
    return json.dumps(s)


def chat_template(tools: bool = True) -> str:
    """The Jinja chat template that renders what :class:`~lmforge.chat.format.ChatFormat` renders.

    Layout (see :mod:`lmforge.chat.format`): the conversation opens with the begin token; system and user
    messages sit between their start/end tokens; the function definitions (``tools``, as ``tojson`` writes them:
    ``json.dumps(..., ensure_ascii=False)``) follow the system message (or open the conversation) between
    ``<|tools_start|>`` and ``<|tools_end|>``; an assistant turn opens with ``<|assistant_start|>`` unless it
    continues after a calculator's output, holds its text, then a calculator call
    ``<|python_start|>EXPR<|python_end|>``, or its function calls (``<|call_start|>{"name": ..., "arguments":
    ...}<|call_end|>`` each) and ``<|assistant_end|>``; a tool message is ``<|output_start|>RESULT<|output_end|>``;
    ``add_generation_prompt`` appends ``<|assistant_start|>``. ``tools=False`` (a tokenizer without the function-
    tool tokens): a conversation with ``tools`` or ``tool_calls`` raises instead of rendering.
    """
    wrap = {"system": (_SYSTEM_START, _SYSTEM_END), "user": (_USER_START, _USER_END),
            "tool": (_OUTPUT_START, _OUTPUT_END)}
    if tools:
        tools_block = (f"{{%- if tools -%}}{{{{- {_lit(_TOOLS_START)} + (tools | tojson) + {_lit(_TOOLS_END)} -}}}}"
                       "{%- endif -%}")
        calls = ("{%- for call in message['tool_calls'] -%}"
                 "{%- set fn = call['function'] if call['function'] is defined else call -%}"
                 "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
                 f"{{{{- {_lit(_CALL_START)} + '{{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args"
                 f" + '}}' + {_lit(_CALL_END)} -}}}}"
                 "{%- endfor -%}")
    else:
        refuse = ("{{- raise_exception('this model has no function-tool tokens: it cannot render tools or "
                  "tool_calls') -}}")
        tools_block = "{%- if tools -%}" + refuse + "{%- endif -%}"
        calls = refuse
    parts = [f"{{{{- {_lit(_BEGIN)} -}}}}", "{%- set ns = namespace(calculator=false) -%}",
             "{%- if not messages or messages[0]['role'] != 'system' -%}" + tools_block + "{%- endif -%}",
             "{%- for message in messages -%}",
             "{%- set content = message['content'] if message['content'] is string else '' -%}"]
    for k, (role, (start, end)) in enumerate(wrap.items()):
        parts.append(f"{{%- {'if' if k == 0 else 'elif'} message['role'] == {_lit(role)} -%}}"
                     f"{{{{- {_lit(start)} + content + {_lit(end)} -}}}}")
        if role == "system":
            parts.append(tools_block)
    parts += [
        "{%- elif message['role'] == 'assistant' -%}",
        f"{{%- if not ns.calculator -%}}{{{{- {_lit(_ASSISTANT_START)} -}}}}{{%- endif -%}}",
        "{{- content -}}",
        "{%- set ns.calculator = message['tool_call'] is defined and message['tool_call'] is string -%}",
        f"{{%- if ns.calculator -%}}"
        f"{{{{- {_lit(_PYTHON_START)} + message['tool_call'] + {_lit(_PYTHON_END)} -}}}}",
        "{%- else -%}",
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}" + calls + "{%- endif -%}",
        f"{{{{- {_lit(_ASSISTANT_END)} -}}}}{{%- endif -%}}",
        "{%- else -%}{{- raise_exception('unknown role ' + message['role'] + '; lmforge chats use system, user, "
        "assistant and tool') -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
        f"{{%- if add_generation_prompt -%}}{{{{- {_lit(_ASSISTANT_START)} -}}}}{{%- endif -%}}",
    ]
    return "".join(parts)


def write_hf_tokenizer(tokenizer: Tokenizer, out: str | Path, context_length: int) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out``.

    ``AutoTokenizer.from_pretrained(out)`` then encodes like ``tokenizer`` after the end-of-text token as BOS
    (module docstring; no EOS added, no clean-up of spaces on decode) and, when the chat tokens exist, carries
    :func:`chat_template`. ``out`` must exist; files are written atomically and replaced (the caller decides
    about overwriting).
    """
    out = Path(out)
    specials = tokenizer.special_tokens
    eot = EOT if EOT in specials else None
    others = [t for t in sorted(specials, key=specials.__getitem__) if t != eot]
    doc = hf_tokenizer_dict(tokenizer.vocab, tokenizer.merges, specials, tokenizer.pattern)
    if eot is not None:
        doc["post_processor"] = bos_post_processor(specials[eot])
    atomic_write_text(out / "tokenizer.json", json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "bos_token": eot, "eos_token": eot, "unk_token": None, "pad_token": None,
        "additional_special_tokens": others,
        "add_bos_token": eot is not None, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for t, i in sorted(specials.items(), key=lambda kv: kv[1])},
    }
    if has_chat_tokens(tokenizer):
        config["chat_template"] = chat_template(tools=all(t in specials for t in TOOL_SPECIAL_TOKENS))
    special_map: dict[str, Any] = {"additional_special_tokens": others}
    if eot is not None:
        special_map.update(bos_token=eot, eos_token=eot)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    atomic_write_text(paths[1], json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(paths[2], json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return paths
