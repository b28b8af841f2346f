"""Tool calling: the model's tool-call format, in and out of the conversation.

A :class:`ToolParser` knows one template family's format. It

- prepares the conversation for the chat template (:meth:`ToolParser.prepare`): when the model's
  template renders tools itself (it mentions ``tools``), the messages go as they are; otherwise the
  tools are described in the system message in the family's format, earlier assistant tool calls
  are written into their content and tool results wrapped as the family expects;
- gives the grammar forcing a call (``tool_choice`` ``required`` or a named function,
  :meth:`ToolParser.forced_grammar`): the arguments are then valid JSON for the function's schema;
- parses the output into ``tool_calls`` (:meth:`ToolParser.parse`) or, streaming, into OpenAI's
  deltas (:class:`ToolCallStream`: content before a call streams as it comes; a call is sent as one
  delta with its id, name and arguments once its closing tag arrived).

Parsers are looked up by name in :data:`xllm.gateway.openai.tool_parsers.TOOL_PARSERS`
(``xllm serve --tool-call-parser``).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from xllm.engine_api.grammar_spec import lark_string


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: no calls, the model's choice, at least one call, or one named function."""

    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None

    @classmethod
    def of(cls, tools: list[dict] | None, choice: str | dict | None) -> ToolChoice:
        if not tools or choice == "none":
            return cls("none")
        if isinstance(choice, dict):
            return cls("named", choice["function"]["name"])
        return cls(choice or "auto")

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]


class ToolParser(Protocol):
    """One template family's tool-call format (see the module docstring)."""

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict], template_renders_tools: bool
                ) -> list[dict[str, Any]]: ...

    def forced_grammar(self, tools: list[dict], choice: ToolChoice, parallel: bool) -> str: ...

    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> ToolCallStream: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(name: str, arguments: Any, call_id: str | None = None) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


class HermesToolParser:
    """Hermes / Qwen 2.5+ format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    results in ``<tool_response>`` tags (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3, SmolLM3)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_call(self, call: dict) -> str:
        fn = call.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        body = json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict], template_renders_tools: bool
                ) -> list[dict[str, Any]]:
        if template_renders_tools:  # templates render arguments as objects (`| tojson`), as vLLM passes them
            return [{**m, "tool_calls": [_arguments_as_object(c) for c in m["tool_calls"]]} if m.get("tool_calls")
                    else m for m in messages]
        out = [dict(m) for m in messages]
        for m in out:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(self.render_call(c) for c in m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
            elif m["role"] == "tool":
                m.pop("tool_call_id", None)
                m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        if tools:
            prompt = self.system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def forced_grammar(self, tools: list[dict], choice: ToolChoice, parallel: bool) -> str:
        """Lark (llguidance): one call (several if ``parallel`` and not named), each a JSON object
        ``{"name": <a tool>, "arguments": <valid for its parameters>}`` in the tags."""
        chosen = [t for t in tools if choice.mode != "named" or t["function"]["name"] == choice.name]
        bodies = []
        for i, tool in enumerate(chosen):
            fn = tool["function"]
            schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": fn["name"]},
                                     "arguments": fn.get("parameters") or {"type": "object"}}}
            bodies.append(f"body_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        calls = 'call ("\\n" call)*' if parallel and choice.mode != "named" else "call"
        return "\n".join([
            f"start: {calls}",
            f"call: {lark_string(self.open_tag + chr(10))} body {lark_string(chr(10) + self.close_tag)}",
            "body: " + " | ".join(f"body_{i}" for i in range(len(chosen))),
            *bodies,
        ])

    def _call(self, body: str) -> dict | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return call_dict(obj["name"], obj.get("arguments", obj.get("parameters", {})))

    def parse(self, text: str) -> ParsedOutput:
        calls: list[dict] = []
        content: list[str] = []
        pos = 0
        pattern = re.compile(re.escape(self.open_tag) + r"(.*?)(?:" + re.escape(self.close_tag) + r"|\Z)", re.S)
        for m in pattern.finditer(text):
            call = self._call(m.group(1).strip())
            if call is None:
                continue
            content.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        rest = "".join(content).strip()
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(rest or None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


@dataclass
class ToolCallStream:
    """Streaming parse of one choice: :meth:`feed` each text delta, :meth:`finish` at the end; each
    returns ``(content delta, tool-call deltas)`` in OpenAI's form (``index``, ``id``, ``type``,
    ``function.name``, ``function.arguments``)."""

    parser: HermesToolParser
    buffer: str = ""
    in_call: bool = False
    calls: int = 0
    _deltas: list[dict] = field(default_factory=list)

    def _emit(self, call: dict) -> None:
        self._deltas.append({"index": self.calls, **call})
        self.calls += 1

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content = []
        open_tag, close_tag = self.parser.open_tag, self.parser.close_tag
        while True:
            if not self.in_call:
                i = self.buffer.find(open_tag)
                if i < 0:
                    keep = _partial_suffix(self.buffer, open_tag)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:i])
                self.buffer = self.buffer[i + len(open_tag):]
                self.in_call = True
            j = self.buffer.find(close_tag)
            if j < 0:
                break
            call = self.parser._call(self.buffer[:j].strip())
            if call is None:  # not a call after all: its text is content
                content.append(open_tag + self.buffer[:j + len(close_tag)])
            else:
                self._emit(call)
            self.buffer = self.buffer[j + len(close_tag):]
            self.in_call = False
        deltas, self._deltas = self._deltas, []
        # whitespace after a call (between calls, before the end) is not content
        text_out = "".join(piece for piece in content if piece.strip() or not self.calls)
        return text_out, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: an unclosed call that parses is a call, anything else content."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            call = self.parser._call(rest.strip())
            if call is not None:
                self._emit(call)
                rest = ""
            else:
                rest = self.parser.open_tag + rest
        deltas, self._deltas = self._deltas, []
        return ("" if self.calls and not rest.strip() else rest), deltas


def _arguments_as_object(call: dict) -> dict:
    """A history tool call with its JSON-text ``arguments`` parsed (left as text when it is not JSON)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

