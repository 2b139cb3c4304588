"""Request bodies of the OpenAI-compatible routes, and the error shape.

Bodies are parsed from raw JSON bytes in strict mode (``Model.model_validate_json``), so a string
where a number belongs is an error, as with the OpenAI API, and invalid JSON is an error of the same
kind (``NaN`` and ``Infinity`` included). ``null`` for a field means its default, as the OpenAI API
and vLLM read it (clients send ``"n": null``, ``"stream": null``). Unknown fields are accepted and
ignored (clients send many we do not use); fields we cannot honour and that would change the output
(``n`` past ``MAX_CHOICES``, the legacy ``functions``/``function_call``) are refused with 400 rather than silently ignored, ``param``
naming the field (``refused``: raised from a validator, it leaves pydantic as it is).
A sampling field a request leaves unset takes the engine's default (``sampling``; the rule is
``models.generation``'s).
``response_format``, ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are parsed here and
honoured by ``chat_format.structured`` (grammars, the model's tool-call format), which
``server.structured`` hands them to.

Every 4xx/5xx body has the OpenAI shape ``{"error": {"message", "type", "code", "param"}}``; a 507
adds ``needed_bytes`` and ``available_bytes`` inside ``error``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from turnkv.chat_format.toolcalls import NAME, template_message
from turnkv.engine.sampling import LOGIT_BIAS_MAX, SEED_MAX, SEED_MIN, SamplingParams
from turnkv.models.generation import SamplingDefaults

MAX_STOP_STRINGS = 4  # as the OpenAI API
MAX_CHOICES = 16  # n: the forks of one prompt a request may ask for (each a running turn)


class ApiError(Exception):
    """An error answered in the OpenAI shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.extra = extra

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code=code, param=param)


def refused(param: str, message: str) -> ApiError:
    """A 400 for a field turnkv cannot honour, naming it. Not a ValueError, so raised in a model
    validator it passes through pydantic (whose model-level errors have no field)."""
    return bad_request(message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``"field": null`` means the field's default (OpenAI clients send explicit nulls)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)
        }


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict  # a JSON string as the OpenAI API sends it (an object is taken too)


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template(self) -> dict:
        """This message as the chat template takes it (``developer`` is a system message; tool
        calls with their arguments as objects, see ``chat_format.toolcalls.template_message``)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.role == "tool":
            out.update(tool_call_id=self.tool_call_id, name=self.name)
        return template_message(out)


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_name(self) -> FunctionDef:
        if not NAME.match(self.name):
            raise ValueError(f"function names must match ^[a-zA-Z0-9_-]{{1,64}}$ (got {self.name[:80]!r})")
        return self


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError(
                'a json_schema response_format needs json_schema.schema ({"type": "json_schema", '
                '"json_schema": {"name": ..., "schema": {...}}})'
            )
        return self


class StreamOptions(_Body):
    include_usage: bool = False


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]


def only(value: Any) -> Any:
    """The one value turnkv honours of a field it accepts for compatibility (what /openapi.json
    says; the validators refuse the rest with a 400 naming the field)."""
    return Field(json_schema_extra={"enum": [value]})


ONE = Field(json_schema_extra={"minItems": 1, "maxItems": 1})  # a batch of one: one prompt per request
TokenIds = Annotated[
    list[Annotated[int, Field(json_schema_extra={"minimum": 0})]], Field(json_schema_extra={"minItems": 1})
]


class _Sampling(_Body):
    """Fields shared by both routes."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension; -1 and 0 mean off
    n: Annotated[int, Field(json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (a JSON key) -> bias added to its logit
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None  # vLLM's extension; 1 is off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # vLLM's extension; 0 is off
    user: str | None = None
    cache_salt: str | None = None  # as vLLM names it: adds to the cache namespace
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> _Sampling:
        if not 1 <= self.n <= MAX_CHOICES:
            raise refused(
                "n",
                f"n must be between 1 and {MAX_CHOICES} (got {self.n}): the choices are forks of one prompt, at most {MAX_CHOICES} a request",
            )
        if self.stop is not None and isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise refused("stop", f"at most {MAX_STOP_STRINGS} stop sequences")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise refused(
                    "logit_bias", f"logit_bias keys must be token ids (decimal integers); got {key[:40]!r}"
                )
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, vocab_size: int, defaults: SamplingDefaults) -> SamplingParams:
        """The sampler's parameters: the request's, else ``defaults`` (the engine's, every field
        set); a ``logit_bias`` id outside the model's ``vocab_size`` logits is a 400."""
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        for tid, _ in bias:
            if tid >= vocab_size:
                raise bad_request(
                    f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})",
                    param="logit_bias",
                )
        d = SamplingDefaults(self.temperature, self.top_p, self.top_k).over(defaults)
        return SamplingParams(
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=max(d.top_k, 0),  # -1 and 0: off
            seed=self.seed,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logit_bias=bias,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            min_p=self.min_p or 0.0,
        )


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # per token, with logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise refused("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def logprobs_top(self) -> int | None:
        """The top alternatives per answer token to report, None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def raw_tools(self) -> list[dict] | None:
        """The tools as the client sent them (what the chat template renders), or None."""
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools] if self.tools else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """Messages as the chat template takes them (``ChatMessage.template``)."""
        return [m.template() for m in self.messages]


class CompletionRequest(_Sampling):
    # a string, a list of one string, or token ids (a list of ints, or a list of one such list)
    prompt: str | Annotated[list[str], ONE] | TokenIds | Annotated[list[TokenIds], ONE]
    # 0 only with echo: the prompt alone (scored, with logprobs)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False  # the prompt's text before each choice's (with logprobs: its tokens' too)
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # top alternatives per token
    suffix: Annotated[str, only("")] | None = None
    best_of: Annotated[int, only(1)] | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise refused("prompt", "prompt must not be empty")
            if isinstance(self.prompt[0], (str, list)) and len(self.prompt) != 1:
                raise refused("prompt", "one prompt per request (a batch of prompts is not supported)")
        if self.max_tokens == 0 and not self.echo:
            raise refused(
                "max_tokens", "max_tokens 0 answers nothing: it needs echo (the prompt, scored with logprobs)"
            )
        if self.suffix:
            raise refused("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise refused("best_of", "best_of must be 1")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_top(self) -> int | None:
        """The top alternatives per prompt token to report (``echo`` with ``logprobs``), or None."""
        return self.logprobs if self.echo else None

    def echo_text(self, tokenizer) -> str:
        """What ``echo`` puts before each choice's text: the prompt as sent (token ids decoded)."""
        if not self.echo:
            return ""
        p = self.single_prompt()
        return p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Validate raw JSON bytes into ``model``; any failure is an :class:`ApiError` 400."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> ApiError:
    """The first problem of a pydantic error, in words a client can act on."""
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    loc = field_path(first.get("loc", ()))
    msg = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{loc}: {msg}" if loc else msg, param=loc or None)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


def field_path(loc: tuple) -> str:
    """A pydantic error's ``loc`` as the client's field path, without the tags pydantic adds for
    the members of a union (``stop.str``, ``tool_choice.literal['none',...]`` -> ``stop``,
    ``tool_choice``); our field names are lower case. List indices read as the grammar checks
    name them: ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper()):
            break
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path
