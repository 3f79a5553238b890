"""Workload and sweep files: a key given twice in one mapping is an error naming the key and its line, never the
last value kept silently; YAML's merge keys still override as YAML defines."""

from __future__ import annotations

import pytest
import yaml

from kvsim.errors import KvsimError
from kvsim.workload.spec import load_workload
from kvsim.workload.yaml_file import parse_yaml
from tests.replay.test_replay import write_tiny

def _line_of(text: str, needle: str, nth: int = 1) -> int:
    """The 1-based line of the `nth` line holding `needle`."""
    return [i for i, line in enumerate(text.splitlines(), 1) if needle in line][nth - 1]


@pytest.mark.parametrize(("edit", "key", "needle", "nth"), [
    (lambda t: t.replace("  count: 24\n", "  count: 24\n  count: 5000\n"), "count", "count: 5000", 1),  # ran 5,000
    (lambda t: t.replace("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, block_size: 32}"), "block_size",
     "block_size: 32", 1),
    (lambda t: t + "seed: 1\n", "seed", "seed:", 2),
])
def test_a_key_given_twice_is_an_error_naming_it(tmp_path, edit, key, needle, nth):
    path = write_tiny(tmp_path)
    plain = path.read_text()
    path.write_text(edit(plain))
    with pytest.raises(KvsimError) as info:
        load_workload(path)
    line = _line_of(edit(plain), needle, nth)
    assert str(info.value).startswith(f"{path}: not valid YAML: key {key!r} given twice at line {line}, column ")
    path.write_text(plain)
    assert load_workload(path).requests.count == 24  # the file as written once loads


def test_merge_keys_still_override_and_equal_keys_in_separate_mappings_are_fine():
    doc = parse_yaml("base: &b {rate: 1.0, cv: 2}\nother:\n  <<: *b\n  rate: 3.0\nthird: {rate: 1.0}\n", source="x.yaml")
    assert doc["other"] == {"rate": 3.0, "cv": 2} and doc["third"] == {"rate": 1.0}
    # a mapping that merges an anchor and overrides one of its keys, itself merged elsewhere: no error, and read as
    # this PyYAML's safe_load reads it (versions differ on the top-level x)
    text = "a: &a {x: 1}\ndefs: &b\n  <<: *a\n  x: 2\n<<: *b\n"
    doc = parse_yaml(text, source="x.yaml")
    assert doc == yaml.safe_load(text) and doc["defs"] == {"x": 2}


def test_a_sweep_file_with_a_key_twice_is_refused(tmp_path):
    from kvsim.sweep.spec import load_sweep

    write_tiny(tmp_path)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: tiny.yaml\naxes: {seed: [1, 2]}\naxes: {seed: [3]}\n")
    with pytest.raises(KvsimError, match=r"not valid YAML: key 'axes' given twice at line 4"):
        load_sweep(path)
