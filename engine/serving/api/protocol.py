"""OpenAI's request and response shapes, with vLLM's extra sampling fields.

Requests forbid fields they do not know, so nothing a client sends is silently ignored: each
field either works as OpenAI (or vLLM) defines it or is refused with a 400 that names it. The
sampling fields shared with `SamplingParams` (same names, types and defaults) are declared
there only and copied into the request models here.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import typing
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from engine.request.beam_search import BeamSearchParams
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import RANGES, SamplingParams
from engine.request.structured import StructuredOutputsParams

SHARED_WITH_SAMPLING_PARAMS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _sampling_fields() -> dict:
    """The fields shared with SamplingParams, with its types, defaults and ranges (RANGES: in
    the OpenAPI schema as minimum / exclusiveMinimum / maximum)."""
    hints = typing.get_type_hints(SamplingParams)
    fields = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name in SHARED_WITH_SAMPLING_PARAMS:
            bounds = _bounds(f.name)
            if f.default is not dataclasses.MISSING:
                fields[f.name] = (hints[f.name], Field(f.default, **bounds))
            else:
                fields[f.name] = (hints[f.name], Field(default_factory=f.default_factory, **bounds))
    return fields


def _bounds(name: str) -> dict:
    """Field()'s bounds for a number SamplingParams ranges (RANGES), else none."""
    if name not in RANGES:
        return {}
    low, high, open_low = RANGES[name]
    return {"gt" if open_low else "ge": low, **({"le": high} if high is not None else {})}


def _sampling_defaults() -> dict:
    return {name: field.get_default(call_default_factory=True) for name, field in _SamplingFields.model_fields.items()}


# Strict: OpenAI's schema types, no coercion (true is not 1, "4" is not 4, 1.0 is not a token id).
STRICT = ConfigDict(extra="forbid", strict=True)
_SamplingFields = create_model("_SamplingFields", __config__=STRICT, **_sampling_fields())


class PauseRequest(BaseModel):
    """POST /pause_generation (SGLang's): "abort" ends the requests in flight, "retract" keeps
    them to compute again when generation continues."""
    model_config = ConfigDict(extra="forbid", strict=True)
    mode: typing.Literal["abort", "retract"] = "abort"
    model: str | None = None


class UpdateWeightsRequest(BaseModel):
    """POST /update_weights_from_disk (SGLang's): a checkpoint of the model's shape."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str
    model: str | None = None


class KVLimitRequest(BaseModel):
    """POST /kv_limits: one model's floor and cap of the shared KV pool, each bytes ("1073741824",
    1073741824) or a share of the pool ("25%"); one left out keeps its current value."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    min: str | typing.Annotated[int, Field(ge=0)] | None = None
    max: str | typing.Annotated[int, Field(ge=0)] | None = None


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter's directory, served under lora_name
    over `model` (default: the first model)."""
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = None


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's clients send it; the name decides


LIMIT = re.compile(r"(\d+(?:\.\d+)?)%|(\d+)", re.ASCII)  # ASCII digits only: no " 50%", "٥٠%", "50_000"


def parse_limit(value: str | int) -> float | int:
    """A KV limit: "25%" -> 0.25 of the pool, "1073741824" or 1073741824 -> bytes; anything else
    (spaces, other scripts' digits, underscores, signs) is refused by name."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = LIMIT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"a KV limit is bytes or a percentage such as 25%, got {value!r}")
    return float(match[1]) / 100 if match[1] is not None else int(match[2])


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(_SamplingFields):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id: with the API key (or the address), who the client is
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: cached KV is shared only with requests of the same salt
    use_beam_search: bool = False  # vLLM's: n is the beam width
    length_penalty: float = Field(1.0, **_bounds("length_penalty"))
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict | str | None = None  # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("user", "cache_salt")
    @classmethod
    def _unicode(cls, value: str | None, info) -> str | None:
        if value is not None and not _is_unicode(value):  # both are hashed into a page's name
            raise ValueError(f"{info.field_name} must be valid Unicode (no lone surrogates)")
        return value

    def structured(self) -> StructuredOutputsParams | None:
        """The one structured-output request among its spellings; ValueError if several."""
        given = {}
        if self.response_format and self.response_format.type != "json_schema" and self.response_format.json_schema:
            raise ValueError(f"response_format of type {self.response_format.type} takes no json_schema: "
                             f"type json_schema follows one")
        if self.response_format and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                given["response_format"] = {"json_object": True}
            elif not (self.response_format.json_schema and self.response_format.json_schema.json_schema is not None):
                raise ValueError("response_format json_schema needs json_schema.schema")
            else:
                given["response_format"] = {"json": self.response_format.json_schema.json_schema}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given[f"guided_{kind}"] = {kind: getattr(self, f"guided_{kind}")}
        if len(given) > 1:
            raise ValueError(f"give one structured output, not {' and '.join(given)}")
        if not given:
            return None
        (name, spec), = given.items()
        if not isinstance(spec, dict) or set(spec) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}:
            raise ValueError(f"{name} takes one of json, json_object, regex, choice, grammar")
        return StructuredOutputsParams(**spec)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        best_of: int | None = None) -> SamplingParams | BeamSearchParams:
        """Raises ValueError, with the reason, for values out of range or combinations refused."""
        if self.use_beam_search:
            refused = [name for name, value in (("logprobs", logprobs), ("stop", self.stop or None),
                                                ("best_of", best_of), ("structured output", self.structured()),
                                                ("logit_bias", self.logit_bias or None)) if value is not None]
            defaults = _sampling_defaults()  # beams are greedy: a sampling field set away from its default would be ignored
            refused += [name for name in SHARED_WITH_SAMPLING_PARAMS
                        if name not in ("n", "ignore_eos", "stop")  # (beams decode without special tokens)
                        and getattr(self, name) != defaults[name] and not (name == "temperature" and self.temperature == 0)]
            if refused:
                raise ValueError(f"{refused[0]} is not supported with beam search (its beams are greedy)")
            return BeamSearchParams(self.n, max_tokens, self.ignore_eos, self.length_penalty)
        if self.length_penalty != 1.0:
            raise ValueError("length_penalty applies to beam search only: set use_beam_search")
        bad = [token for token in self.logit_bias or {} if not (token.isascii() and token.isdigit() and len(token) <= 9)]
        if bad:  # int() would also read " 5", "+5" and "٥" as 5
            raise ValueError(f"logit_bias keys must be token ids written as plain digits, got {bad[0]!r}")
        bias = {int(token): value for token, value in (self.logit_bias or {}).items()}
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not _is_unicode(stop) for stop in stops):
            raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        shared = {name: getattr(self, name) for name in SHARED_WITH_SAMPLING_PARAMS}
        return SamplingParams(**shared, max_tokens=max_tokens, logprobs=logprobs, best_of=best_of, logit_bias=bias,
                              structured_outputs=self.structured())


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _NonEmpty:
    def __class_getitem__(cls, kind):
        return typing.Annotated[kind, Field(min_length=1)]


NonEmpty = _NonEmpty  # NonEmpty[str], NonEmpty[list[int]]: at least one character or item


class CompletionRequest(_Request):
    prompt: str | NonEmpty[list[str]] | NonEmpty[list[int]] | NonEmpty[list[NonEmpty[list[int]]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, **_bounds("logprobs"))
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


# vkv's models read text: a part of another type (image_url, input_audio, file, refusal) is refused
# by the schema itself, naming its type ("Input tag 'image_url' ... does not match ... 'text'").
ContentPart = typing.Annotated[typing.Union[TextPart], Field(discriminator="type")]


class _Message(BaseModel):
    """A chat message, one class per role as OpenAI's schema has them, so the OpenAPI schema says
    which fields each role takes. Participant names and non-text parts are refused: the model
    and its chat template have no place for them. Tool results (role "tool") and an assistant's
    earlier tool calls are written into the conversation by engine/serving/api/tools.py."""
    model_config = ConfigDict(extra="forbid")

    def to_dict(self, i: int) -> dict:
        """{"role", "content"} for the chat template; ValueError naming what is refused."""
        return {"role": CHAT_ROLES[self.role], "content": _text(self.content)}


class SystemMessage(_Message):
    role: Literal["system", "developer"]  # developer is OpenAI's new name for system
    content: str | list[ContentPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[ContentPart]


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[ContentPart]
    tool_call_id: str  # the call it answers


class AssistantMessage(_Message):
    # OpenAI's rule, in the schema: content (not null), or at least one tool call
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})
    role: Literal["assistant"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # its calls, in OpenAI's shape

    def to_dict(self, i: int) -> dict:
        """With "tool_calls" as {"name", "arguments"} when it made calls."""
        where = f"messages[{i}]"
        if self.content is None and not self.tool_calls:
            raise ValueError(f"{where}: an assistant message has content, tool_calls or both")
        if not self.tool_calls:
            return super().to_dict(i)
        return {"role": "assistant", "content": _text(self.content) if self.content is not None else "",
                "tool_calls": [_call_of(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(self.tool_calls)]}


ChatMessage = typing.Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


def _call_of(call, where: str) -> dict:
    """An assistant's earlier tool call, {"name", "arguments"}; ValueError if malformed."""
    fn = call.get("function") if isinstance(call, dict) else None
    try:
        arguments = json.loads(fn["arguments"]) if isinstance(fn, dict) and isinstance(fn.get("arguments"), str) \
            else None
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(arguments, dict):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": "<JSON object>"}}}}')
    return {"name": fn["name"], "arguments": arguments}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **_bounds("logprobs"))
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def conversation(self) -> list[dict]:
        return conversation_of(self.messages)


def conversation_of(messages: list[_Message]) -> list[dict]:
    """The messages for the chat template; ValueError naming what is refused, such as a tool
    result that answers no earlier call (OpenAI's 400)."""
    called = set()
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            called |= {c.get("id") for c in m.tool_calls or [] if isinstance(c, dict)}
        elif isinstance(m, ToolMessage) and m.tool_call_id not in called:
            raise ValueError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an "
                             f"earlier assistant message")
    return [m.to_dict(i) for i, m in enumerate(messages)]


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's fields)."""
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with a conversation, through the chat template (vLLM's fields; a template of
    the client's own, its kwargs and multimodal options are refused by name)."""
    model_config = STRICT
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[dict] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""
    model_config = STRICT
    model: str | None = None
    tokens: list[typing.Annotated[int, Field(ge=0)]]


# -- responses -----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) for o in outputs)  # (a beam search's output has none)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def envelope(kind: str, request_id: str, model: str, choices: list, extra: dict | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, **(extra or {})}
