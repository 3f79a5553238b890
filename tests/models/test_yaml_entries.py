"""The data files read entry by entry: each entry parsed alone is what the whole file's parse holds for it."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from kvsim.models.yaml_entries import entries_fields, entry_texts, parse_entry

DATA_FILES = ["models.yaml", "hardware.yaml", "interconnect.yaml"]


@pytest.mark.parametrize("name", DATA_FILES)
def test_every_entry_parsed_alone_equals_the_whole_file(name):
    text = resources.files("kvsim.models").joinpath(f"data/{name}").read_text()
    whole = yaml.safe_load(text)
    texts = entry_texts(text, name)
    assert list(texts) == list(whole)  # every entry, in file order
    assert {key: parse_entry(key, part, name) for key, part in texts.items()} == whole


@pytest.mark.parametrize("name, fields", [("models.yaml", ("hf_id", "aliases")), ("hardware.yaml", ("aliases",))])
def test_one_line_fields_equal_the_whole_files(name, fields):
    text = resources.files("kvsim.models").joinpath(f"data/{name}").read_text()
    whole = yaml.safe_load(text)
    expected = {key: {f: entry[f] for f in fields if f in entry} for key, entry in whole.items()}
    assert entries_fields(entry_texts(text, name), *fields) == expected
    assert sum(len(v.get("aliases", [])) for v in expected.values()) > 20  # the fields were really there


TEXT = """\
# opening comment
# more comment

first:
  a: 1
  aliases: [x, y]
  nested:
    b: [1, 2]

# a comment between entries
second-one:  # a comment after the name
  a: two
third:
  aliases: [z]
"""


def test_entries_comments_and_blank_lines():
    texts = entry_texts(TEXT, "test.yaml")
    assert list(texts) == ["first", "second-one", "third"]
    assert parse_entry("first", texts["first"], "test.yaml") == {"a": 1, "aliases": ["x", "y"], "nested": {"b": [1, 2]}}
    assert parse_entry("second-one", texts["second-one"], "test.yaml") == {"a": "two"}
    assert entries_fields(texts, "aliases") == {"first": {"aliases": ["x", "y"]}, "second-one": {}, "third": {"aliases": ["z"]}}


def test_a_top_level_value_is_not_an_entry():
    with pytest.raises(AssertionError, match="holds a value"):
        entry_texts("first:\n  a: 1\nversion: 3\n", "test.yaml")
