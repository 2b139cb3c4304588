"""What a JSON schema must be before it is compiled (turnkv/chat_format/schema_check.py) and how
deep a history's tool-call arguments may nest (turnkv/chat_format/toolcalls.py ``json_depth``): pure
functions, no model. The schemas refused here are the ones llguidance accepts and then fails on
mid-turn."""

from __future__ import annotations

import pytest

from turnkv.chat_format.pattern_size import pattern_size
from turnkv.chat_format.schema_check import DEPTH_MAX, LITERAL_MAX, PATTERN_MAX, SchemaProblem, check
from turnkv.chat_format.toolcalls import json_depth

NODE = {  # a linked list that may end: finite values exist
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["v", "next"],
}
ENDLESS = {  # a linked list that never ends
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/endless"}},
    "required": ["v", "next"],
}


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
        ({"$ref": "#"}, "#"),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#"),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2}, "#"),
        ({"allOf": [{"$ref": "#"}]}, "#"),
        (
            {
                "$defs": {"endless": ENDLESS},
                "type": "object",
                "properties": {"l": {"$ref": "#/$defs/endless"}},
            },
            "#/properties/l",
        ),
        (
            {"$defs": {"endless": ENDLESS}, "anyOf": [{"type": "string"}, {"$ref": "#/$defs/endless"}]},
            "#/anyOf/1",
        ),
        ({"type": "object", "minProperties": 1, "additionalProperties": {"$ref": "#"}}, "#"),
    ],
)
def test_a_schema_whose_values_are_all_infinite_is_refused_where_it_recurses(schema, where):
    with pytest.raises(SchemaProblem, match="every value it admits is infinite") as e:
        check(schema)
    assert str(e.value).startswith(where + ":"), e.value


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
        {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"],
        },
        {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a string or a number ends it
        {
            "anyOf": [
                {"type": "string"},
                {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
            ]
        },
        {"$ref": "#/$defs/missing"},  # not resolvable here: llguidance names it
        {"type": "object", "properties": {"a": False}},  # false: never taken, not recursion
        nested(DEPTH_MAX - 2),
    ],
)
def test_schemas_with_a_finite_value_pass(schema):
    check(schema)


def test_client_x_guidance_at_the_root_is_refused_not_honoured():
    with pytest.raises(SchemaProblem, match="x-guidance"):
        check({"type": "object", "x-guidance": {"whitespace_flexible": True, "lenient": True}})
    check({"type": "object", "properties": {"x-guidance": {"type": "string"}}})  # a property of that name


def test_nesting_past_the_limit_is_refused_without_recursing():
    with pytest.raises(SchemaProblem, match=f"nests deeper than {DEPTH_MAX} levels"):
        check(nested(DEPTH_MAX + 1))
    with pytest.raises(SchemaProblem, match="nests deeper"):
        check(nested(20_000))  # a loop, not recursion: no RecursionError


@pytest.mark.parametrize(
    "pattern, size",
    [
        ("^a{3}$", 3),
        (r"^\d{3}-\d{4}$", 8),
        ("(ab){3}", 6),
        ("(a|bc){2}", 6),
        ("a{2,5}", 5),
        ("a{3,}", 3),
        ("a*b+c?", 3),
        ("[a-z{}]{10}", 10),
        (r"\p{L}{4}", 4),
        ("(([a-z]{1,20}){1,20}){1,20}", 8000),
        ("x{99999999999999999999}", 10**12),  # saturates
    ],
)
def test_pattern_size_multiplies_counted_repetitions_out(pattern, size):
    assert pattern_size(pattern) == size


def test_patterns_and_literals_past_their_limits_are_refused_where_they_are():
    email = r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,255}\.[A-Za-z]{2,63}$"
    check({"type": "string", "pattern": email})
    bomb = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(([a-z]{1,20}){1,20}){1,20}$"}},
    }
    with pytest.raises(
        SchemaProblem, match=rf"^#/properties/s: pattern .* 8000 characters.*at most {PATTERN_MAX}"
    ):
        check(bomb)
    with pytest.raises(SchemaProblem, match=r"^#: pattern '\^a\{100000\}\$'"):
        check({"type": "object", "patternProperties": {"^a{100000}$": {}}})
    for schema in (
        {"const": "x" * LITERAL_MAX},
        {"enum": ["a", "y" * LITERAL_MAX]},
        {"properties": {"k" * 5000: {}}},
    ):
        with pytest.raises(SchemaProblem, match=f"longer than {LITERAL_MAX}"):
            check(schema)


def test_subschemas_of_many_alternatives_are_returned_for_probing_with_the_definitions():
    union = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"$ref": "#/$defs/n"}}} for i in range(80)]}
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"u": union}}
    [(where, alone)] = check(schema)
    assert (
        where == "#/properties/u" and alone["anyOf"] == union["anyOf"] and alone["$defs"] == schema["$defs"]
    )
    assert check({"anyOf": union["anyOf"]}) == []  # the root: the whole grammar is probed anyway
    small = {"type": "object", "properties": {"u": {"anyOf": union["anyOf"][:10]}}}
    assert check(small) == []
    elsewhere = {**schema, "properties": {"u": union, "w": {"$ref": "#/properties/u"}}}
    assert check(elsewhere) == []  # a $ref outside the definitions would not resolve alone


@pytest.mark.parametrize(
    "value, depth",
    [
        ("{}", 1),
        ('{"a": [1, {"b": 2}]}', 3),
        ('{"a": "[[[[ not brackets"}', 1),
        ('"\\"[["', 0),
        ("[" * 5000, 5000),  # not JSON: still measured, without recursion
        ("not json", 0),
        ({"a": [1, {"b": [2]}]}, 4),
        ([], 1),
        (7, 0),
    ],
)
def test_json_depth_counts_nesting_of_text_or_values(value, depth):
    assert json_depth(value) == depth
