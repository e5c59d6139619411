"""Stage: chat. The chat format (messages -> ``(ids, loss_mask)``), its special tokens and a preview.

``format`` owns the rendered layout (documented there with a worked example) and the JSONL reader;
``preview`` shows the trained tokens of a rendered conversation; ``tools`` is the calculator a tool call runs.
"""

from lmforge.chat.format import (CHAT_SPECIAL_TOKENS, ROLES, ChatFormat, add_chat_tokens, check_conversation,
                                 load_conversations, read_conversations)
from lmforge.chat.preview import render_jsonl_preview, render_preview
from lmforge.chat.tools import ToolUse, calculate, run_tool

__all__ = ["CHAT_SPECIAL_TOKENS", "ROLES", "ChatFormat", "add_chat_tokens", "check_conversation",
           "load_conversations", "read_conversations", "render_jsonl_preview", "render_preview", "calculate", "run_tool", "ToolUse"]
