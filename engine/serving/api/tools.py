"""Tool calling on /v1/chat/completions, in the Hermes format (vLLM's `--tool-call-parser hermes`).

The prompt: a chat template that takes `tools` gets them; one that does not (SmolLM2's) gets
the Hermes instruction as the start of the system message: the functions' JSON signatures
inside <tools></tools>, and "answer a call as <tool_call>{"name": ..., "arguments": {...}}
</tool_call>". Earlier calls in the history are written back the same way, and tool results
come as user turns inside <tool_response></tool_response>.

The answer, by `tool_choice`:
  "none"      the tools are not offered and nothing is parsed
  "auto"      (the default with tools) the model may call: every <tool_call> block of its text
              that parses as a call to an offered function becomes a tool call (the first only,
              if parallel_tool_calls is false, as vLLM does), the rest stays content; a `strict`
              function is refused here (free text cannot be held to its schema)
  "required"  the output is constrained (structured outputs) to a JSON array of one or more
              calls (one object if parallel_tool_calls is false), each one function's name and
              arguments valid for its `parameters` schema
  a function  the output is constrained to that function's arguments
With "required" or a named function every call's arguments follow its schema, so `strict: true`
holds there as OpenAI defines it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.request.structured import StructuredOutputsParams

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict
    strict: bool = False  # OpenAI's: arguments must follow `parameters`; enforced where the output is constrained


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools, checked."""
    functions: tuple[Function, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return bool(self.functions) and self.choice != "none"


def tool_use(tools: list | None, tool_choice, parallel: bool | None) -> ToolUse:
    """The request's tools and choice, checked; ValueError naming what is wrong."""
    functions = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if set(tool) - {"type", "function"}:
            raise ValueError(f"tools[{i}]: unknown field {sorted(set(tool) - {'type', 'function'})[0]!r}")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ValueError(f"tools[{i}].function: unknown field {sorted(unknown)[0]!r}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -")
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema of type object (a function "
                             f"takes named arguments), got {params.get('type') if isinstance(params, dict) else params!r}")
        if fn.get("strict") not in (None, True, False):
            raise ValueError(f"tools[{i}].function.strict must be true or false")
        functions.append(Function(name, str(fn.get("description") or ""), params, fn.get("strict") is True))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools name the same function twice")
    if tool_choice is None:
        choice, named = ("auto" if functions else "none"), None
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}")
        choice, named = tool_choice, None
    else:
        named = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(named, str):
            raise ValueError('tool_choice names a function as {"type": "function", "function": {"name": ...}}')
        choice = "named"
    if choice in ("auto", "required", "named") and not functions:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    if parallel is not None and not functions:
        raise ValueError("parallel_tool_calls needs tools")
    strict = [f.name for f in functions if f.strict]
    if strict and choice == "auto":
        raise ValueError(f"strict function {strict[0]!r}: its arguments are enforced by its schema under tool_choice "
                         f"\"required\" or naming a function; under \"auto\" calls are parsed from free text, "
                         f"so strict cannot hold (drop strict, or choose required)")
    return ToolUse(tuple(functions), choice, named, parallel is not False)


def render(messages: list[dict], use: ToolUse, template_takes_tools: bool) -> tuple[list[dict], list | None]:
    """The conversation for the chat template, and the `tools` to hand it (None: written into
    the system message here, or not offered)."""
    schemas = [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                 "parameters": f.parameters}} for f in use.functions]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if not use.offered:
        return out, None
    if template_takes_tools:
        return out, schemas
    signatures = "\n".join(json.dumps(s) for s in schemas)
    instruction = ("# Tools\n\nYou may call one or more functions to answer. Their signatures, inside "
                   f"<tools></tools>:\n<tools>\n{signatures}\n</tools>\n\nTo call a function, answer with a JSON "
                   "object of its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instruction}
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out, None


def guide(use: ToolUse) -> StructuredOutputsParams | None:
    """The structured output that enforces "required" or a named function (None otherwise)."""
    if use.choice == "named":
        return StructuredOutputsParams(json=next(f.parameters for f in use.functions if f.name == use.named))
    if use.choice != "required":
        return None
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False} for f in use.functions]}
    return StructuredOutputsParams(json={"type": "array", "items": call, "minItems": 1} if use.parallel else call)


def calls_in(text: str, use: ToolUse) -> tuple[str | None, list[dict]]:
    """The completion as (content, tool calls in OpenAI's shape)."""
    if use.choice == "named":
        return None, [_call(use.named, json.loads(text))]
    if use.choice == "required":
        found = json.loads(text)
        return None, [_call(c["name"], c["arguments"]) for c in (found if isinstance(found, list) else [found])]
    if use.choice != "auto":
        return text, []
    names, calls = {f.name for f in use.functions}, []

    def take(match: re.Match) -> str:
        try:
            found = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not (isinstance(found, dict) and found.get("name") in names and isinstance(found.get("arguments", {}), dict)):
            return match.group(0)
        calls.append(_call(found["name"], found.get("arguments", {})))
        return ""
    content = CALL.sub(take, text).strip()
    return (content or None) if calls else text, calls[:None if use.parallel else 1]


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
