"""What a request constrains its output to (structured outputs), and the grammar xgrammar builds for
it. No torch and no tokenizer: the gateway checks that a request's grammar parses (400 naming its
field) before any worker sees it; the engine compiles it for its tokenizer (`engine/grammar.py`).
xgrammar is imported on first use only (it brings torch and transformers: seconds and hundreds of MB)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
JSON_SEPARATORS = (", ", ": ")
"""JSON is emitted with these separators and no other whitespace (xgrammar's `any_whitespace=False`):
with free whitespace a small model pads with newlines until `max_tokens` (SmolLM2-135M wrote 130 of
160 tokens as newlines) and the answer never closes."""
_ANY_OBJECT_SCHEMA = '{"type":"object"}'
_XGR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A spec that does not compile, or token ids a grammar refuses: xgrammar's words, minus its source location."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. Built with the helpers below, which make equal asks
    equal specs: it keys the compile cache and travels in SamplingParams between processes.

    kind:   one of KINDS.
    text:   json_schema: the schema as compact JSON, keys in the caller's order (xgrammar emits
            properties in declared order, so sorting them would change the output); regex: the
            pattern; choice: a JSON list of the strings; grammar: EBNF (GBNF, root rule `root`);
            json_object: "".
    strict: json_schema only (True elsewhere): properties and items the schema does not name are
            refused (xgrammar's strict_mode; `additionalProperties: true` still allows them).
    """

    kind: str
    text: str
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not self.strict and self.kind != "json_schema":
            raise GrammarError(f"strict=False is a json_schema option, not one of {self.kind!r}")
        if self.kind == "json_object" and self.text:
            raise GrammarError("a json_object spec has no text: use json_schema for a schema")
        if self.kind == "choice":
            _check_choices(self.text)

    @staticmethod
    def json_schema(schema: dict | bool, strict: bool = True) -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
        return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")),
                           strict)

    @staticmethod
    def json_object() -> GrammarSpec:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return GrammarSpec("json_object", "")

    @staticmethod
    def regex(pattern: str) -> GrammarSpec:
        return GrammarSpec("regex", pattern)

    @staticmethod
    def choice(choices: Sequence[str]) -> GrammarSpec:
        """Exactly one of `choices`, whole."""
        return GrammarSpec("choice", json.dumps(list(choices), ensure_ascii=False))

    @staticmethod
    def grammar(ebnf: str) -> GrammarSpec:
        return GrammarSpec("grammar", ebnf)


def _check_choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice text is not a JSON list: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError(f"choice text must be a non-empty JSON list of strings, not {text[:80]!r}")
    return choices


def choice_ebnf(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are EBNF string escapes too; an empty choice is "".
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in _check_choices(text))


def grammar_of(spec: GrammarSpec) -> Any:
    """`spec` as an xgrammar `Grammar` (not yet compiled for a tokenizer); GrammarError when it does
    not parse. Seconds on its first call in a process (the import), milliseconds after."""
    import xgrammar as xgr

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema, strict = (spec.text, spec.strict) if spec.kind == "json_schema" else (_ANY_OBJECT_SCHEMA, False)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS,
                                                strict_mode=strict)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.text) if spec.kind == "choice" else spec.text)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's C++ errors are RuntimeErrors
        raise compile_error(spec, exc) from None


def compile_error(spec: GrammarSpec, exc: Exception) -> GrammarError:
    """xgrammar's error, minus its timestamp and source location."""
    lines = (_XGR_PREFIX.sub("", line).strip() for line in str(exc).splitlines())
    return GrammarError(f"{spec.kind} does not compile: {' '.join(filter(None, lines))[:1000]}")
