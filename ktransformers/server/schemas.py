"""Pydantic request and response models for the OpenAI, Ollama and Assistants routes.

Request models ignore unknown fields (clients send many we do not use) but check the types of
the ones we read; a bad value becomes a 400 naming the field (see ``errors.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError,
                      WrapValidator, field_validator, model_validator)

#: a sampling seed: any integer; the engine reduces it modulo 2**64, the seeds a torch.Generator
#: takes (OpenAI's and Ollama's are 64-bit), so every 64-bit seed keeps its meaning
Seed = int

#: placeholder in the JSON Schema of a token id; :func:`document_model_limits` puts the model's
#: vocabulary in its place when the app builds its OpenAPI document (the check is the engine's)
_VOCABULARY = "x-kt-vocabulary"
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0, _VOCABULARY: True})]
#: placeholder of a model name: the names the server answers to (``check_model``); an OpenAI
#: request may also leave it empty (the served model)
_MODEL = "x-kt-model"
ModelName = Annotated[str, Field(json_schema_extra={_MODEL: "openai"})]
OllamaModelName = Annotated[str, Field(json_schema_extra={_MODEL: "ollama"})]
#: placeholder of a prompt text: ``minLength: 1`` where the tokenizer makes no token of ''
_PROMPT_TEXT = "x-kt-prompt-text"
PromptText = Annotated[str, Field(json_schema_extra={_PROMPT_TEXT: True})]


#: placeholder of an embedding's ``dimensions``: the model's hidden size, the one size it has
_EMBEDDING_SIZE = "x-kt-embedding-size"
EmbeddingSize = Annotated[int, Field(json_schema_extra={_EMBEDDING_SIZE: True})]


def document_model_limits(schema: Any, *, model_name: str, vocab_size: int, empty_prompt_has_tokens: bool,
                          embedding_size: int | None = None) -> Any:
    """The OpenAPI document with this model's limits in place of the placeholders (in place)."""
    base = model_name.removesuffix(":latest")
    names = {"ollama": sorted({model_name, base, f"{base}:latest"})}
    names["openai"] = names["ollama"] + [""]

    def fill(node):
        if isinstance(node, dict):
            if node.pop(_VOCABULARY, False):
                node["maximum"] = vocab_size - 1
            if node.pop(_PROMPT_TEXT, False) and not empty_prompt_has_tokens:
                node["minLength"] = 1
            if node.pop(_EMBEDDING_SIZE, False) and embedding_size:
                node["minimum"] = node["maximum"] = embedding_size
            family = node.pop(_MODEL, None)
            if family:
                node["enum"] = names[family]
            for v in node.values():
                fill(v)
        elif isinstance(node, list):
            for v in node:
                fill(v)

    fill(schema)
    return schema


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate (valid JSON, not Unicode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path or 'body'}: lone surrogate {value[e.start]!r} at character {e.start}"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and not k.startswith("["):
            bad = lone_surrogate(k, path) or lone_surrogate(v, f"{path}.{k}" if path else k)
        else:
            bad = lone_surrogate(v, f"{path}{k}")
        if bad:
            return bad
    return None


# ---- JSON Schemas of shapes the routes check by hand (so their errors name the item) ------
# The OpenAPI document states exactly what the checks accept; the schemathesis run in the tests
# holds the two together (a valid body is answered, an invalid one gets a 400).

_TEXT_KINDS = ["text", "input_text", "output_text"]
#: a text part as ``content_text`` reads it (``text`` may be the Assistants shape ``{"value": ...}``);
#: other parts (images) are refused: the models here take text only
TEXT_PART_SCHEMA = {"type": "object", "properties": {
    "type": {"enum": _TEXT_KINDS},
    "text": {"anyOf": [{"type": "string"}, {"type": "null"},
                       {"type": "object", "properties": {"value": {"type": "string"}}}]}}}
#: a text part of a stored thread message: its text is there, as a string or ``{"value": string}``
THREAD_TEXT_PART_SCHEMA = {"type": "object", "required": ["text"], "properties": {
    "type": {"enum": _TEXT_KINDS},
    "text": {"anyOf": [{"type": "string"},
                       {"type": "object", "required": ["value"], "properties": {"value": {"type": "string"}}}]}}}
#: message content of the chat routes: a string, or parts (strings or text parts)
CHAT_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "null"},
                                 {"type": "array", "items": {"anyOf": [{"type": "string"}, TEXT_PART_SCHEMA]}}]}
#: content of an Assistants thread message: a string or text parts
THREAD_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": THREAD_TEXT_PART_SCHEMA}]}
#: content of a Responses input message: a string or text-part objects
MESSAGE_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "properties": {
        "type": {"enum": _TEXT_KINDS}, "text": {"type": "string"}}}}]}
#: a function call's output: as a message's content, or null
ITEM_CONTENT_SCHEMA = {"anyOf": [{"type": "null"}, *MESSAGE_CONTENT_SCHEMA["anyOf"]]}
#: OpenAI's rule for a function (tool) name: 1 to 64 letters, digits, '_' or '-'
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def tool_name_problem(name: Any) -> str | None:
    """Why ``name`` is not a function name a request may declare (None when it is one)."""
    import re

    if not isinstance(name, str):
        return f"must be a string, not {json_type_name(name)}"
    if not re.fullmatch(TOOL_NAME_PATTERN, name):
        shown = name if len(name) <= 40 else name[:40] + f"… ({len(name)} characters)"
        return f"{shown!r} is not a function name: 1 to 64 letters, digits, '_' or '-'"
    return None


#: a Responses tool: only function tools run here
FUNCTION_TOOL_SCHEMA = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": TOOL_NAME_PATTERN}}}
#: one Responses / Conversations input item (``normalize_items`` checks it)
INPUT_ITEM_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message", "", None]},
        "role": {"enum": ["user", "assistant", "system", "developer"]}, "content": MESSAGE_CONTENT_SCHEMA}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": ITEM_CONTENT_SCHEMA}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"const": "reasoning"}, "summary": {"type": ["array", "null"]},
        "content": {"type": ["array", "null"]}}}]}


_I64 = 2**63


def exact_integers(value: Any) -> Any:
    """``value`` with integral floats beyond 64 bits as the integers they are (``1.8e19`` is the
    integer JSON Schema sees; pydantic reads a float into an integer field only within 64 bits)."""
    if isinstance(value, float) and abs(value) >= _I64 and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: exact_integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exact_integers(v) for v in value]
    return value


def _json_kinds(annotation) -> set[str]:
    """The JSON scalar kinds a field's type takes ('other' for objects, lists, Any)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _json_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_json_kinds(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {"bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "string"
                for v in typing.get_args(annotation)}
    return {bool: {"bool"}, int: {"number"}, float: {"number"}, str: {"string"},
            type(None): {"null"}}.get(annotation, {"other"})


def _kind(value) -> str:
    return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else \
        "string" if isinstance(value, str) else "other"


class _Checked(BaseModel):
    """Request bodies: no NaN/Infinity numbers, text that is valid Unicode, and scalars of the
    JSON type the field has: pydantic would read ``true`` as 1, ``1`` or ``"yes"`` as true."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = lone_surrogate(data)
        if bad:
            raise ValueError(f"{bad} is not valid Unicode")
        if isinstance(data, dict):
            for name, f in cls.model_fields.items():
                v = data.get(f.alias or name)
                if v is None:
                    continue
                kinds = _json_kinds(f.annotation)
                if "other" not in kinds and _kind(v) != "other" and _kind(v) not in kinds:
                    want = " or ".join(sorted(k for k in kinds if k != "null"))
                    raise ValueError(f"'{name}' must be a {want}, not {json_type_name(v)}")
        return exact_integers(data)


def json_type_name(v) -> str:
    """The JSON name of a value's type, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, (dict, list)):
        return "object" if isinstance(v, dict) else "array"
    return {"bool": "boolean", "number": "number", "string": "string"}.get(_kind(v), type(v).__name__)


class _Req(_Checked):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class _Open(_Checked):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)


# ---- OpenAI chat / completions --------------------------------------------------------------

class FunctionCall(_Open):
    name: str = ""
    arguments: str | dict | None = None


class ToolCall(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any] | str] | None = Field(None, json_schema_extra=CHAT_CONTENT_SCHEMA)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Open):
    name: str = Field(json_schema_extra={"pattern": TOOL_NAME_PATTERN})
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _tool_name(cls, v):
        problem = tool_name_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Req):
    include_usage: bool = False


MAX_STOP = 16


def _check_stop(v):
    if isinstance(v, list) and len(v) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    return v


#: a request's ``stop``: one string or at most MAX_STOP of them (checked wherever the type is used)
StopType = Annotated[str | Annotated[list[str], Field(json_schema_extra={"maxItems": MAX_STOP})] | None,
                     AfterValidator(_check_stop)]


class SamplingFields(_Req):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension
    max_tokens: int | None = Field(None, ge=1)
    seed: Seed | None = None
    stop: StopType = None
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    n: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})  # n > 1 gets its own 400
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    model: ModelName | None = None
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = Field(None, json_schema_extra={"enum": [False, None]})  # true gets its own 400
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the chat template (vLLM's name)

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("messages must contain at least one message")
        return v


class CompletionRequest(SamplingFields):
    model: ModelName | None = None
    prompt: (PromptText | Annotated[list[PromptText], Field(json_schema_extra={"minItems": 1})]
             | Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
             | Annotated[list[Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]],
                         Field(json_schema_extra={"minItems": 1})])
    suffix: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 0})  # > 0 gets its own 400
    best_of: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})  # > 1 gets its own 400

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ktransformers"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # <think>…</think>, as DeepSeek's API returns it
    tool_calls: list[dict[str, Any]] | None = None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


# ---- embeddings ---------------------------------------------------------------------------

#: OpenAI's limit on the inputs of one embeddings request
MAX_EMBEDDING_INPUTS = 2048
_NonEmptyText = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Req):
    model: ModelName | None = None
    input: (_NonEmptyText | Annotated[list[_NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | _TokenIds | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: EmbeddingSize | None = None  # the model's hidden size only: its vectors have no shorter form
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v):
        problem = _embedding_input_problem(v)
        if problem:
            raise ValueError(problem)
        return v


def _integer(x) -> bool:
    """An integer as JSON Schema counts them (``30.0`` is one)."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def _embedding_input_problem(v) -> str | None:
    """What is wrong with an embeddings ``input``, in words (a union's own errors name its members)."""
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(v, str):
        return "must not be empty" if not v else None
    if not isinstance(v, list):
        return f"must be {shapes}, not {json_type_name(v)}"
    if not v:
        return "must not be an empty list"
    if len(v) > MAX_EMBEDDING_INPUTS:
        return f"holds {len(v)} inputs; at most {MAX_EMBEDDING_INPUTS} per request"
    for i, x in enumerate(v):
        if isinstance(x, str) and not x:
            return f"[{i}] must not be empty"
        if isinstance(x, list) and not x:
            return f"[{i}] must not be an empty list of token ids"
    kinds = {"str" if isinstance(x, str) else "int" if _integer(x)
             else "ids" if isinstance(x, list) and all(_integer(t) for t in x) else "other" for x in v}
    if len(kinds) > 1 or "other" in kinds:
        return f"must be {shapes} (not a mix)"
    return None


class OllamaEmbedRequest(_Req):
    model: OllamaModelName
    input: PromptText | Annotated[list[PromptText], Field(max_length=MAX_EMBEDDING_INPUTS)]
    truncate: bool = True  # cut an input longer than the context to its start (false: a 400)
    dimensions: EmbeddingSize | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(_Req):
    """The legacy ``/api/embeddings`` body: one ``prompt``."""

    model: OllamaModelName
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaPullRequest(_Req):
    # the served model, as 'model' or 'name' (each one given names it): any other is a 400
    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["model"]}, {"required": ["name"]}]})
    model: OllamaModelName = None  # a string when given (null names nothing)
    name: OllamaModelName = None  # older clients
    stream: bool = True
    insecure: bool = False


# ---- Ollama -------------------------------------------------------------------------------

#: Ollama's ``num_predict`` values without a count: -1 (until the model stops) and -2 (fill the
#: context); both are bounded here by the server's --max_new_tokens and the context
UNTIL_LIMIT = (-1, -2)


class OllamaOptions(_Req):
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    num_predict: int | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "integer", "minimum": 1}, {"enum": list(UNTIL_LIMIT)}, {"type": "null"}]})
    stop: StopType = None
    seed: Seed | None = None
    repeat_penalty: float | None = Field(None, gt=0.0)
    num_ctx: int | None = None  # accepted; the context is fixed at server start (--cache_lens)

    @field_validator("num_predict")
    @classmethod
    def _num_predict(cls, v):
        if v is not None and v < 1 and v not in UNTIL_LIMIT:
            raise ValueError(f"must be a positive token count, -1 or -2 (got {v})")
        return v


class OllamaMessage(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = Field(None, json_schema_extra={"maxItems": 0})  # text-only models: a 400
    tool_calls: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Req):
    model: OllamaModelName
    prompt: str | None = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[TokenId] | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None
    images: list[str] | None = Field(None, json_schema_extra={"maxItems": 0})  # text-only models: a 400
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None
    think: bool | Literal["low", "medium", "high"] | None = None


class OllamaChatRequest(_Req):
    model: OllamaModelName
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None
    think: bool | Literal["low", "medium", "high"] | None = None


class OllamaShowRequest(_Req):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # the model's name, as 'model' or 'name'
        {"required": ["model"], "properties": {"model": {"type": "string", _MODEL: "ollama"}}},
        {"required": ["name"], "properties": {"name": {"type": "string", _MODEL: "ollama"}}}]})
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False


# ---- Assistants ---------------------------------------------------------------------------

#: OpenAI's metadata limits: 16 keys of up to 64 characters, string values of up to 512
META_KEYS, META_KEY_CHARS, META_VALUE_CHARS = 16, 64, 512


def _one_metadata_error(value, handler):
    """A metadata error names the field (OpenAI's ``param: metadata``) and, in the message, the key."""
    try:
        return handler(value)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        where = f"key '{loc[0][:20]}': " if "[key]" in loc else (f"'{loc[0][:20]}': " if loc else "")
        raise ValueError(where + err["msg"]) from None


Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=META_KEY_CHARS)],
                          Annotated[str, StringConstraints(max_length=META_VALUE_CHARS)]],
                     Field(max_length=META_KEYS), WrapValidator(_one_metadata_error)] | None


class AssistantCreate(_Req):
    model: ModelName | None = None
    name: str | None = Field(None, max_length=256)
    description: str | None = Field(None, max_length=512)
    instructions: str | None = Field(None, max_length=256_000)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_resources: dict[str, Any] | None = None
    metadata: Metadata = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    response_format: str | dict[str, Any] | None = None


class AssistantModify(_Req):
    model: ModelName | None = None
    name: str | None = Field(None, max_length=256)
    description: str | None = Field(None, max_length=512)
    instructions: str | None = Field(None, max_length=256_000)
    tools: list[dict[str, Any]] | None = None
    tool_resources: dict[str, Any] | None = None
    metadata: Metadata = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    response_format: str | dict[str, Any] | None = None


class MessageCreate(_Req):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(json_schema_extra=THREAD_CONTENT_SCHEMA)
    attachments: list[dict[str, Any]] | None = None
    metadata: Metadata = None


class ThreadCreate(_Req):
    messages: list[MessageCreate] | None = None
    tool_resources: dict[str, Any] | None = None
    metadata: Metadata = None


class MetadataModify(_Req):
    metadata: Metadata = None
    tool_resources: dict[str, Any] | None = None


class RunCreate(_Req):
    assistant_id: str
    model: ModelName | None = None
    instructions: str | None = None
    additional_instructions: str | None = None
    additional_messages: list[MessageCreate] | None = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra={"maxItems": 0})  # not supported yet
    metadata: Metadata = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    truncation_strategy: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: str | dict[str, Any] | None = None
    stream: bool = False


class ThreadAndRunCreate(RunCreate):
    thread: ThreadCreate | None = None


class RunModify(_Req):
    metadata: Metadata = None
