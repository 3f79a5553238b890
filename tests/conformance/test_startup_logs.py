"""kvsim's start-up terms beside real vLLM start-up logs (kvsim/conformance/startup_logs/logs.yaml), term by term."""

from __future__ import annotations

import pytest

from kvsim.conformance.startup_check import GOAL, load_logs, kvsim_case, run, table

LOGS = load_logs()
# How far each kvsim term may be from the logged one (GiB): weights are computed, the rest estimated; the CUDA graph
# estimate is within 0.3 GiB but for DeepSeek-V2-Lite's MLA graphs (0.65 under) and Llama-3.1-8B at tp 2 (0.85)
TOLERANCE = {"weights": 0.2, "activation": 0.3, "non_torch": 0.25, "cudagraph": 0.9}


@pytest.mark.parametrize("entry", LOGS, ids=[e["id"] for e in LOGS])
def test_each_logged_term(entry):
    case = kvsim_case(entry)
    version = tuple(int(part) for part in str(entry["vllm_version"]).split("."))
    current = version >= (0, 17)  # the profile run's peak shrank 2.5x in 0.17 (see the notes)
    for term, tolerance in TOLERANCE.items():
        logged = entry["logged"].get(term)
        if logged is None or (term == "activation" and not current):
            continue
        assert abs(case.kvsim[term] - logged) <= tolerance, (term, case.kvsim[term], logged)
    if case.hit and not entry.get("out_of_sample"):
        assert current  # the fitted logs of releases before 0.17 miss by their larger profile peak
    else:
        assert "note" in entry, "every miss is explained"
    if current and entry["logged"].get("tokens") and case.tokens:  # vLLM's arithmetic from the budget on: exact
        assert case.tokens / entry["logged"]["tokens"] == pytest.approx(case.kvsim["available"] / entry["logged"]["available"], rel=0.01)


def test_at_least_80_percent_of_the_logs_within_3_percent_or_0_3_gib():
    cases = run()
    assert len(cases) >= 30
    assert sum(c.hit for c in cases) >= GOAL * len(cases)
    text = table(cases)
    assert text.count("**miss**") == sum(not c.hit for c in cases) and "logs within 3% or 0.3 GiB" in text
