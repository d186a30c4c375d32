"""The request fields of structured output, ``logit_bias`` and ``min_p``, shared by chat and
completions, and their conversion to the engine's ``GuidedSpec`` (docs/serving.md, Structured output).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epdserve.engine.request import LOGIT_BIAS_LIMIT, MAX_GUIDED_CHARS, MAX_LOGIT_BIAS, GuidedSpec
from epdserve.serving.api.errors import APIError

INT32_MAX = 2**31 - 1


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: ``name`` (a-z, A-Z, 0-9, _ and -, at most
    64), ``description``, ``schema`` (required here: there is nothing to enforce without
    it) and ``strict`` (the schema is enforced exactly either way, as vLLM does)."""

    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``json_object``,
    ``regex``, ``choice``, ``grammar``. vLLM's other keys (whitespace and backend options)
    are refused rather than ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _schema_text(schema: str | dict | bool, param: str) -> str:
    """Raises APIError naming ``param``: a string that is not JSON."""
    if not isinstance(schema, str):
        return json.dumps(schema, ensure_ascii=False)
    try:
        json.loads(schema)
    except ValueError as exc:
        raise APIError(f"{param}: not valid JSON: {exc}", param=param) from None
    return schema


class GuidedFields(BaseModel):
    """Structured output (OpenAI's ``response_format``; vLLM's ``guided_*`` and
    ``structured_outputs``), ``logit_bias`` (OpenAI) and ``min_p`` (vLLM)."""

    response_format: ResponseFormat | None = None
    guided_json: str | dict | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        for key, bias in v.items():
            if not key.isdecimal() or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"token {key}: bias {bias} is outside [-100, 100]")
        return v

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}

    def guided_spec(self) -> tuple[str, GuidedSpec] | None:
        """``(the field that gave it, spec)`` or None. Raises APIError naming the field: two constraints,
        a schema string not JSON, a value over ``MAX_GUIDED_CHARS`` characters."""
        given: dict[str, tuple[str, str]] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given["response_format"] = ("json_object", "")
        elif rf is not None and rf.type == "json_schema":
            given["response_format"] = ("json", _schema_text(rf.json_schema.schema_, "response_format"))
        for name, kind, value in (("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                                  ("guided_choice", "choice", self.guided_choice),
                                  ("guided_grammar", "grammar", self.guided_grammar)):
            if value is not None:
                given[name] = (kind, value)
        so = self.structured_outputs
        if so is not None:
            for name, kind, value in (("json", "json", so.json_), ("regex", "regex", so.regex),
                                      ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar)):
                if value is not None:
                    given[f"structured_outputs.{name}"] = (kind, value)
            if so.json_object:
                given["structured_outputs.json_object"] = ("json_object", "")
        if len(given) > 1:
            raise APIError(f"at most one structured-output constraint per request, got {len(given)}: "
                           f"{', '.join(given)}", param=next(iter(given)))
        if not given:
            return None
        (name, (kind, value)), = given.items()
        if kind == "json":
            value = _schema_text(value, name)
        elif kind == "choice":
            value = json.dumps(value, ensure_ascii=False)
        if len(value) > MAX_GUIDED_CHARS:
            raise APIError(f"{name}: {len(value)} characters, over the limit of {MAX_GUIDED_CHARS}", param=name)
        return name, GuidedSpec(kind=kind, value=value)
