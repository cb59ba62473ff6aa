"""json_values.kind: the one wording of a JSON value's kind in every reader's error (JSON's words, a
bool never "a number" though Python's bool is an int)."""

from __future__ import annotations

import json

import pytest

from k3_amd_overlay import json_values


@pytest.mark.parametrize("text,words", [
    ('{"a": 1}', "an object"), ("[1]", "a list"), ('"x"', "a string"), ("true", "true or false"),
    ("false", "true or false"), ("3", "a number"), ("2.5", "a number"), ("1e400", "a number"), ("null", "null"),
])
def test_each_json_kind_in_jsons_words(text: str, words: str) -> None:
    assert json_values.kind(json.loads(text)) == words


def test_a_value_json_cannot_hold_is_named_by_its_type() -> None:
    assert json_values.kind((1, 2)) == "tuple"
