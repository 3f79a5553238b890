"""Parallel sampling (`requests: {n: N}`) as vLLM v1 serves it: each prompt fans out into n child requests that
arrive together with one prompt and their own output tokens, and share the prompt through prefix caching."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.replay.options import ReplayOptions
from kvsim.replay.run import run_replay
from kvsim.workload.requests import generate_requests, make_token_ids
from kvsim.workload.spec import load_workload

WORKLOAD = """\
name: samples
seed: 4
model: qwen3-0.6b
kv_dtype: bf16
hardware: h100-80gb
kv_budget: 2GiB
max_model_len: 2048
requests:
  count: 6
  {n}
  arrival: {{process: poisson, rate: 2.0}}
  prompt_tokens: {{dist: uniform, min: 40, max: 600}}
  output_tokens: {{dist: uniform, min: 8, max: 64}}
allocators:
  - {{kind: paged, block_size: 16, prefix_caching: true}}
scheduler: {{max_num_seqs: 64, max_num_batched_tokens: 2048}}
"""


def load(tmp_path, n: str):
    path = tmp_path / "samples.yaml"
    path.write_text(WORKLOAD.format(n=n))
    return load_workload(path)


def test_each_prompt_fans_out_into_n_children_sharing_its_prompt(tmp_path):
    one = generate_requests(load(tmp_path, ""))
    four = generate_requests(load(tmp_path, "n: 4"))
    assert len(one) == 6 and len(four) == 24
    assert [r.request_id for r in four] == list(range(24))
    for i, parent in enumerate(one):
        children = four[4 * i : 4 * i + 4]
        # vLLM copies the parent's SamplingParams with n=1: same prompt, arrival and max_tokens
        assert {(c.arrival_time, c.num_prompt_tokens, c.max_tokens) for c in children} == {
            (parent.arrival_time, parent.num_prompt_tokens, parent.max_tokens)}
        assert [c.prompt_of for c in children] == [None, 4 * i, 4 * i, 4 * i]
        ids = [make_token_ids(c, 4) for c in children]
        p = parent.num_prompt_tokens
        assert all(np.array_equal(x[:p], ids[0][:p]) for x in ids)  # one prompt
        outputs = {tuple(x[p:]) for x in ids}
        assert len(outputs) == 4 or parent.max_tokens == 0  # each sample its own output tokens


def test_children_share_the_prompt_through_prefix_caching(tmp_path):
    result = run_replay(load(tmp_path, "n: 3"), ReplayOptions(tensors=False), workers=1)
    (run,) = result.runs
    assert not np.isnan(run.finished_s).any()
    prompts = result.num_prompt_tokens.reshape(6, 3)
    # the samples after the first are admitted with the prompt's full blocks from the cache (the last token computed)
    assert run.prefix_hit_tokens >= int(((prompts[:, 1:] - 1) // 16 * 16).sum())


def test_n_must_be_a_whole_number_of_samples(tmp_path):
    with pytest.raises(KvsimError, match="n"):
        load(tmp_path, "n: 0")
