"""The router's OpenAPI document validates with a real validator and its examples are what the
Structs decode (requests are also answerable: they pass the router's own checks)."""
from __future__ import annotations

import json

import msgspec
import pytest
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from kvpipe.processors.core.index import Index
from kvpipe.processors.router import model
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.openapi import document, encoded


def test_the_document_is_valid_openapi_3_1():
    doc = json.loads(encoded())
    validate(doc)
    assert doc["openapi"] == "3.1.0" and {"/route", "/route/sent", "/route/finished", "/openapi.json"} <= set(doc["paths"])
    props = doc["components"]["schemas"]["RouteRequest"]["properties"]
    assert {"token_ids", "block_hashes", "num_tokens", "semantics", "top_k", "include_zero", "request_id"} <= set(props)


def test_the_validator_would_catch_a_broken_document():
    doc = document()
    doc["paths"]["/route"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] = {"$ref": 42}
    with pytest.raises(OpenAPIValidationError):
        validate(doc)


def examples(doc: dict):
    for path, ops in doc["paths"].items():
        for op in ops.values():
            bodies = [op.get("requestBody", {})] + list(op["responses"].values())
            for body in bodies:
                for media in body.get("content", {}).values():
                    ref = media["schema"].get("$ref")
                    for name, ex in media.get("examples", {}).items():
                        yield path, ref.rsplit("/", 1)[-1], name, ex["value"]


def test_every_example_decodes_into_its_struct_and_request_examples_are_answerable():
    seen = set()
    for path, struct_name, name, value in examples(json.loads(encoded())):
        cls = getattr(model, struct_name)
        obj = msgspec.json.decode(json.dumps(value), type=cls)
        seen.add((struct_name, name))
        if cls is model.RouteRequest:
            answer = route(Index(), obj, now=0.0)  # no nodes: an empty answer, not an error
            assert answer.chosen is None and answer.nodes == []
    assert {("RouteRequest", "token_ids"), ("RouteRequest", "block_hashes"), ("RouteAnswer", "answer"),
            ("ErrorBody", "wrong_block_size"), ("SentReport", "sent")} <= seen


def test_an_unknown_request_field_is_a_400_that_names_it():
    with pytest.raises(model.RouteError) as err:
        model.decode_request(b'{"token_ids": [1], "tokens": [2]}')
    assert err.value.status == 400 and "tokens" in err.value.detail
    with pytest.raises(model.RouteError, match="temprature"):  # a misspelt knob is not silently ignored
        model.decode_request(b'{"token_ids": [1], "scoring": {"temprature": 1.0}}')
