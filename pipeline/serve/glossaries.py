"""Glossaries over HTTP (docs/glossary.md): the server's named glossaries (`--glossary NAME=FILE`), each read
once at start and checked against every served model (one start-up error naming NAME and the file); a
request's "glossary" field, a name or an inline object of terms, resolved and checked against the model it
goes to (GlossaryError: an ApiError, the route's 400 naming the field and the entry); and each answer's
"terms".

A glossary only adds: the text service finds the terms of each unit and the batcher hands their target
tokens to the constrained search (runtime/texts.py, runtime/translate.py); a request without one is encoded,
batched, searched and answered exactly as before."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from model.errors import UserError
from pipeline.serve.http import ApiError, json_object
from runtime.errors import RuntimeUserError
from runtime.glossary import Glossary, applied_terms
from runtime.glossary_file import check_glossary, glossary_from_mapping, load_glossary
from runtime.model_dir import Loaded
from runtime.texts import EncodedTexts, TextResult

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a simple identifier: never mistaken for an inline glossary
FIELD = "glossary"

Terms = list[dict[str, Any]]  # per term found: {"source", "target", "applied", "constrained"}


class GlossaryError(ApiError):
    """A request's "glossary" that cannot be used: an unknown name, a malformed or oversized inline glossary,
    a target the model cannot spell, a backend that cannot apply one (a 400 with this message)."""

    def __init__(self, message: str):
        super().__init__(400, message)


def read_named(specs: tuple[str, ...]) -> dict[str, tuple[str, Glossary]]:
    """--glossary NAME=FILE, each file read and checked (runtime/glossary.py load_glossary), by NAME; a
    UserError naming NAME (and, from the file, its line) otherwise."""
    named: dict[str, tuple[str, Glossary]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path or not NAME.fullmatch(name):
            raise UserError(f"--glossary {spec!r}: give NAME=FILE, NAME a simple identifier (ASCII letters, digits "
                            "and '_', not starting with a digit; at most 64)")
        if name in named:
            raise UserError(f"--glossary {name}: given twice ({named[name][0]} and {path}); name each glossary once")
        try:
            named[name] = (path, load_glossary(path))
        except RuntimeUserError as e:  # it names FILE:LINE
            raise UserError(f"--glossary {name}: {e}") from None
    return named


def check_named(named: Mapping[str, tuple[str, Glossary]], models: Mapping[str, Loaded]
                ) -> dict[str, Glossary]:
    """The named glossaries, each checked against every served model: its backend can apply one and its
    vocabulary spells every fixed target (UserError naming NAME, the file and the model otherwise)."""
    for name, (path, glossary) in named.items():
        for model, loaded in models.items():
            try:
                usable(glossary, loaded)
            except RuntimeUserError as e:
                raise UserError(f"--glossary {name} ({path}), model {model}: {e}") from None
    return {name: glossary for name, (_, glossary) in named.items()}


def usable(glossary: Glossary, loaded: Loaded) -> None:
    """RuntimeUserError unless the model can apply `glossary` (runtime/texts.py check_glossary)."""
    if len(glossary):
        check_glossary(glossary, loaded.tokenizer, loaded.backend)


def requested(value: Any, known: Mapping[str, Glossary]) -> Glossary | None:
    """A request's "glossary": None (absent, null or ""), the name of one of the server's, or an inline
    object of terms (`{"Hund": "dog", "Acme": ""}`; in form data or the query string that object as a JSON
    string), checked as runtime/glossary.py glossary_from_mapping checks one (MAX_REQUEST_TERMS entries)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value, object_pairs_hook=json_object)
        except (ValueError, RecursionError) as e:
            raise GlossaryError(f'"{FIELD}" starts with {{ but is not a JSON object of terms: '
                                f"{str(e).split(';')[0][:200]}") from None
    if isinstance(value, str):
        if value in known:
            return known[value]
        has = f"it has {', '.join(known)}" if known else "it has none (--glossary NAME=FILE names them)"
        raise GlossaryError(f'"{FIELD}" {value[:40]!r} is not a glossary of this server; {has}; or send the '
                            'terms inline, {"source term": "target term", ...}')
    if not isinstance(value, dict):
        raise GlossaryError(f'"{FIELD}" must be the name of one of this server\'s glossaries or an object of terms '
                            f'{{"source term": "target term"}}, not {type(value).__name__}')
    try:
        return glossary_from_mapping(value, where=FIELD)
    except RuntimeUserError as e:  # glossary['Hund']: ... / glossary: N entries, more than MAX_REQUEST_TERMS
        raise GlossaryError(str(e)) from None


def for_model(glossary: Glossary | None, loaded: Loaded, known: Mapping[str, Glossary]) -> None:
    """GlossaryError unless the model the request goes to can apply its glossary; the server's own were
    checked against every model at start."""
    if glossary is None or any(glossary is g for g in known.values()):
        return
    try:
        usable(glossary, loaded)
    except RuntimeUserError as e:  # an entry's problem names it (glossary['Hund']: ...), the backend's the field
        message = str(e)
        raise GlossaryError(message if message.startswith(f"{FIELD}[") else f'"{FIELD}": {message}') from None


def text_terms(results: list[TextResult]) -> list[Terms]:
    """Per text, its terms found and whether its translation holds each ([] for none)."""
    return [result.terms or [] for result in results]


def unit_terms(encoded: EncodedTexts, unit: int, translation: str) -> Terms:
    """One unit's terms and whether its translation holds each (a streamed line or sentence)."""
    return applied_terms(encoded.terms[unit], translation) if encoded.terms is not None else []


def info(known: Mapping[str, Glossary]) -> dict[str, Any]:
    """/info's "glossaries": each name with its number of entries (never its file's path)."""
    return {name: {"entries": len(glossary)} for name, glossary in known.items()}
