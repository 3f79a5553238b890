"""Workload and sweep files: a key given twice in one mapping is an error naming the key and its line, never the
last value kept silently; YAML's merge keys still override as YAML defines."""

from __future__ import annotations

import pytest

from kvsim.errors import KvsimError
from kvsim.workload.spec import load_workload
from kvsim.workload.yaml_file import parse_yaml

WORKLOAD = """\
name: dup
seed: 0
model: qwen3-0.6b
kv_dtype: bf16
hardware: h100-80gb
kv_budget: 1GiB
max_model_len: 4096
requests:
  count: 500
  arrival: {process: poisson, rate: 50.0}
  prompt_tokens: {dist: uniform, min: 8, max: 64}
  output_tokens: {dist: uniform, min: 8, max: 64}
allocators:
  - {kind: paged, block_size: 16}
"""


@pytest.mark.parametrize(("edit", "key", "line"), [
    (lambda t: t.replace("  count: 500\n", "  count: 500\n  count: 5000\n"), "count", 10),  # ran 5,000 requests
    (lambda t: t.replace("{kind: paged, block_size: 16}", "{kind: paged, block_size: 16, block_size: 32}"), "block_size", 14),
    (lambda t: t + "seed: 1\n", "seed", 15),
])
def test_a_key_given_twice_is_an_error_naming_it(tmp_path, edit, key, line):
    path = tmp_path / "w.yaml"
    path.write_text(edit(WORKLOAD))
    with pytest.raises(KvsimError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}: not valid YAML: key {key!r} given twice at line {line}, column ")
    path.write_text(WORKLOAD)
    assert load_workload(path).requests.count == 500  # the file as written once loads


def test_merge_keys_still_override_and_equal_keys_in_separate_mappings_are_fine():
    doc = parse_yaml("base: &b {rate: 1.0, cv: 2}\nother:\n  <<: *b\n  rate: 3.0\nthird: {rate: 1.0}\n", source="x.yaml")
    assert doc["other"] == {"rate": 3.0, "cv": 2} and doc["third"] == {"rate": 1.0}


def test_a_sweep_file_with_a_key_twice_is_refused(tmp_path):
    from kvsim.sweep.spec import load_sweep

    (tmp_path / "w.yaml").write_text(WORKLOAD)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: w.yaml\naxes: {seed: [1, 2]}\naxes: {seed: [3]}\n")
    with pytest.raises(KvsimError, match=r"not valid YAML: key 'axes' given twice at line 4"):
        load_sweep(path)
