"""The routing app's OpenAPI document (the router endpoints and the app's own) validates with a real
validator and its examples are what the Structs decode (requests are also answerable: they pass the
router's own checks). Every route the app registers is in it: tests/unit/test_http_answers.py."""
from __future__ import annotations

import json

import msgspec
import pytest
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from kvpipe.processors.core.index import Index
from kvpipe.processors.core.answers import ErrorBody
from kvpipe.processors.router import model, openapi as router_openapi
from kvpipe.processors.router.decide import route
from kvpipe.processors.routing.apidoc import TYPES, document, encoded

STRUCTS = {cls.__name__: cls for cls in (*TYPES, ErrorBody)}


def test_the_document_is_valid_openapi_3_1():
    doc = json.loads(encoded())
    validate(doc)
    assert doc["openapi"] == "3.1.0" and {"/route", "/route/sent", "/route/finished", "/openapi.json", "/nodes",
                                          "/stats", "/metrics", "/health"} <= set(doc["paths"])
    router_only = json.loads(router_openapi.encoded())  # the router endpoints alone, as a bare server serves them
    validate(router_only)
    assert set(router_only["paths"]) == {"/route", "/route/sent", "/route/finished", "/openapi.json"}
    props = doc["components"]["schemas"]["RouteRequest"]["properties"]
    assert {"token_ids", "block_hashes", "num_tokens", "semantics", "top_k", "include_zero", "request_id"} <= set(props)


def test_the_validator_would_catch_a_broken_document():
    doc = document()
    doc["paths"]["/route"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] = {"$ref": 42}
    with pytest.raises(OpenAPIValidationError):
        validate(doc)


def examples(doc: dict):
    """`(path, struct names, example name, value)` of every example; a schema of several (`anyOf`) names each."""
    for path, ops in doc["paths"].items():
        for op in ops.values():
            bodies = [op.get("requestBody", {})] + list(op["responses"].values())
            for body in bodies:
                for media in body.get("content", {}).values():
                    schema = media["schema"]
                    refs = [s["$ref"] for s in schema.get("anyOf", [schema]) if "$ref" in s]
                    for name, ex in media.get("examples", {}).items():
                        yield path, [r.rsplit("/", 1)[-1] for r in refs], name, ex["value"]


def decoded(struct_names: list[str], value):
    """The value decoded into the first of its Structs that takes it (strictly: no unknown field either)."""
    for struct_name in struct_names:
        strict = msgspec.defstruct(f"Strict{struct_name}", [], bases=(STRUCTS[struct_name],),
                                   forbid_unknown_fields=True)
        try:
            return struct_name, msgspec.json.decode(json.dumps(value), type=strict)
        except msgspec.ValidationError:
            continue
    raise AssertionError(f"{value!r} decodes into none of {struct_names}")


def test_every_example_decodes_into_its_struct_and_request_examples_are_answerable():
    seen = set()
    for path, struct_names, name, value in examples(json.loads(encoded())):
        struct_name, obj = decoded(struct_names, value)
        seen.add((struct_name, name))
        if isinstance(obj, model.RouteRequest):
            answer = route(Index(), obj, now=0.0)  # no nodes: an empty answer, not an error
            assert answer.chosen is None and answer.nodes == []
    assert {("RouteRequest", "token_ids"), ("RouteRequest", "block_hashes"), ("RouteAnswer", "answer"),
            ("ErrorBody", "wrong_block_size"), ("SentReport", "sent"), ("NodesPage", "page"),
            ("RoutingHealth", "health")} <= seen


def test_an_unknown_request_field_is_a_400_that_names_it():
    with pytest.raises(model.RouteError) as err:
        model.decode_request(b'{"token_ids": [1], "tokens": [2]}')
    assert err.value.status == 400 and "tokens" in err.value.detail
    with pytest.raises(model.RouteError, match="temprature"):  # a misspelt knob is not silently ignored
        model.decode_request(b'{"token_ids": [1], "scoring": {"temprature": 1.0}}')
