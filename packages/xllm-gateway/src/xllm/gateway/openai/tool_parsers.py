"""The tool-call parsers by name (``xllm serve --tool-call-parser``); listing them imports none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm.common import NameRegistry

if TYPE_CHECKING:
    from xllm.gateway.openai.tools import ToolParser

TOOL_PARSERS: NameRegistry[type[ToolParser]] = NameRegistry("tool-call parser", {
    "hermes": "xllm.gateway.openai.tools:HermesToolParser",
})
TOOL_PARSERS.alias("qwen", "hermes")
DEFAULT_TOOL_PARSER = "hermes"
