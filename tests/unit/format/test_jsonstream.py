"""`jsonstream.Reader`: a JSON text read a value at a time, with what one value may take bounded.
No server."""

from __future__ import annotations

import json

import pytest

from s3ckpt.format.jsoncheck import Invalid
from s3ckpt.format.jsonstream import Reader


def test_members_and_items_walk_what_json_loads_reads() -> None:
    text = ' { "a" : [1, {"b": [true, null]}, "x"] ,"c":{}, "d": [ ] }  '
    reader = Reader(text, "doc")
    walked: dict[str, object] = {}
    for key in reader.members("doc"):
        if key == "a":
            walked[key] = [reader.value(f"a[{i}]", 64) for i in reader.items("a")]
        else:
            walked[key] = reader.value(key, 64)
    reader.end()
    assert walked == json.loads(text)


def test_a_container_larger_than_its_limit_is_refused_before_it_is_parsed() -> None:
    reader = Reader("[" + ",".join(["{}"] * 100_000) + "]", "doc")
    with pytest.raises(Invalid, match="x: more than 65536 bytes of JSON"):
        reader.value("x", 64 * 1024)
    reader = Reader(
        '"' + "s" * 100_000 + '"', "doc"
    )  # a string: about its text, whatever its length
    assert len(reader.value("x", 64)) == 100_000


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ('{"a": 1', "Expecting ',' delimiter or '}'"),
        ('{"a" 1}', "Expecting ':' delimiter"),
        ("{1: 2}", "Expecting property name"),
        ('{"a": [1, 2}', "Expecting ',' delimiter or ']'"),
        ('{"a": [1}]}', "Expecting ',' delimiter or ']'"),
        ("", "Expecting value"),
        ('{"a": 1} x', "Extra data"),
    ],
)
def test_syntax_errors_say_where(text: str, cause: str) -> None:
    reader = Reader(text, "the doc")
    with pytest.raises(Invalid, match=f"the doc is not valid JSON.*{cause}.*char"):
        for key in reader.members(""):
            if reader.peek() == "[":
                for i in reader.items(key):
                    reader.value(f"{key}[{i}]", 64)
            else:
                reader.value(key, 64)
        reader.end()


def test_a_key_twice_in_one_object_is_refused_however_it_is_checked() -> None:
    for into in (None, {}):
        reader = Reader('{"a": 1, "b": 2, "a": 3}', "doc")
        with pytest.raises(Invalid, match="key 'a' appears twice"):
            for key in reader.members("", into=into):
                value = reader.value(key, 64)
                if into is not None:
                    into[key] = value


def test_a_value_of_the_wrong_kind_is_named() -> None:
    reader = Reader('{"a": [1]}', "doc")
    key = next(reader.members(""))
    with pytest.raises(Invalid, match="a: expected a JSON object, got '\\[1\\]}'"):
        next(reader.members(key))
