"""Trace files: the three forms parse to the same requests, bad rows name file, line and column."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import SHARED
from kvsim.errors import KvsimError
from kvsim.workload.traces import read_trace

AZURE_CONV = SHARED / "traces" / "azure-conv-2023.csv"

# The same four requests in each form; the file order is not the arrival order (a 1.5 s request comes last).
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n0.25,396,109\n4.5,879,55\n1.5,91,16\n"
AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.0000000,374,44\n"
    "2023-11-16 18:15:46.2500000,396,109\n"
    "2023-11-16 18:15:50.5000000,879,55\n"
    "2023-11-16 18:15:47.5000000,91,16\n"
)
JSONL = "".join(
    json.dumps({"arrival_time": t, "prompt_tokens": p, "output_tokens": o}) + "\n"
    for t, p, o in [(0.0, 374, 44), (0.25, 396, 109), (4.5, 879, 55), (1.5, 91, 16)]
)


@pytest.mark.parametrize("form, text", [("vidur", VIDUR), ("azure", AZURE), ("jsonl", JSONL)])
def test_each_form_parses_sorted_by_arrival(tmp_path, form, text):
    path = tmp_path / "trace.txt"  # the form comes from the content, not the file name
    path.write_text(text)
    trace = read_trace(path)
    assert trace.form == form and len(trace) == 4
    assert np.allclose(trace.arrival_time, [0.0, 0.25, 1.5, 4.5])
    assert trace.num_prompt_tokens.tolist() == [374, 396, 91, 879]
    assert trace.num_output_tokens.tolist() == [44, 109, 16, 55]
    assert trace.num_prompt_tokens.dtype == np.int64 and trace.arrival_time.dtype == np.float64


def test_an_unsorted_trace_is_said_so_once_on_stderr(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text(VIDUR)
    read_trace(path)
    read_trace(path)  # a sweep reads the trace once per point: said once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert f"{path}: arrivals are not in file order (request 4 of the file" in err[0]
    assert "1 of 4 do" in err[0] and "request ids number the requests in that order" in err[0]
    sorted_path = tmp_path / "sorted.csv"
    sorted_path.write_text(VIDUR.replace("4.5,879,55\n1.5,91,16", "1.5,91,16\n4.5,879,55"))
    read_trace(sorted_path)
    assert capsys.readouterr().err == ""


def test_time_scale_and_limit(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(VIDUR)
    trace = read_trace(path, time_scale=2.0, limit=3)
    assert np.allclose(trace.arrival_time, [0.0, 0.5, 3.0])  # the first 3 by arrival, times doubled
    assert trace.num_prompt_tokens.tolist() == [374, 396, 91]


def test_extra_columns_crlf_bom_and_blank_lines(tmp_path):
    path = tmp_path / "t.csv"
    text = "\ufeffid,arrived_at,num_decode_tokens,num_prefill_tokens\r\n7,1.0,5,10\r\n\r\n8,2.0,6,11.0\r\n"
    path.write_text(text, newline="")
    trace = read_trace(path)
    assert trace.num_prompt_tokens.tolist() == [10, 11] and trace.num_output_tokens.tolist() == [5, 6]


def test_azure_timezones_and_fractions(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:15:46+00:00,1,1\n2023-11-16T19:15:46.5+01:00,2,2\n")
    assert np.allclose(read_trace(path).arrival_time, [0.0, 0.5])


@pytest.mark.parametrize(
    "text, message",
    [
        (VIDUR + "5.0,abc,3\n", "line 6, column num_prefill_tokens: expected a whole number from 1 to 16,777,216, got 'abc'"),
        (VIDUR + "5.0,0,3\n", "line 6, column num_prefill_tokens: expected a whole number from 1 to 16,777,216, got '0'"),
        (VIDUR + "5.0,10,-1\n", "line 6, column num_decode_tokens: expected a whole number from 0 to 16,777,216, got '-1'"),
        (VIDUR + "-1,10,1\n", "line 6, column arrived_at: expected seconds >= 0, got '-1'"),
        (VIDUR + "nan,10,1\n", "line 6, column arrived_at: expected seconds >= 0"),
        (VIDUR + "5.0,10\n", "line 6: expected 3 columns, got 2"),
        # a fourth cell was ignored: '109' typed as '10,9' replayed 10 output tokens
        (VIDUR + "5.0,396,10,9\n", "line 6: expected 3 columns, got 4"),
        (AZURE + "2023-11-16 18:15:51,5,10,9\n", "line 6: expected 3 columns, got 4"),
        (AZURE.replace("18:15:50", "yesterday"), "line 4, column TIMESTAMP: expected a date-time"),
        (JSONL + '{"arrival_time": 1, "prompt_tokens": 5}\n', "line 5: missing key 'output_tokens'"),
        (JSONL + '{"arrival_time": 1, "prompt_tokens": 2.5, "output_tokens": 1}\n', "line 5, column prompt_tokens: expected a whole number"),
        (JSONL + '{"arrival_time": 1,\n', "line 5: not valid JSON"),
        (JSONL + "[1, 2, 3]\n", "line 5: expected a JSON object"),
        # json.loads keeps the last of a repeated key: these replayed 5,000 prompt tokens, and the second timestamp
        (JSONL + '{"arrival_time": 1, "prompt_tokens": 100, "output_tokens": 5, "prompt_tokens": 5000}\n',
         "line 5: key 'prompt_tokens' given 2 times"),
        ('{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1], "timestamp": 9000}\n',
         "line 1: key 'timestamp' given 2 times"),
        ("time,prompt,output\n1,2,3\n", "line 1: unrecognised trace header 'time,prompt,output'"),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n", "trace has no requests"),
    ],
)
def test_bad_rows_name_file_line_and_column(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(KvsimError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(KvsimError, match="cannot read trace"):
        read_trace(tmp_path / "none.csv")


@pytest.mark.skipif(not AZURE_CONV.is_file(), reason="needs ../shared/traces/azure-conv-2023.csv")
def test_azure_conversation_trace():
    trace = read_trace(AZURE_CONV)
    assert trace.form == "vidur" and len(trace) == 19_366
    assert abs(trace.num_prompt_tokens.mean() - 1155) < 1 and abs(trace.num_output_tokens.mean() - 211) < 1
    assert trace.num_prompt_tokens.max() == 14_050 and trace.num_output_tokens.max() == 1_000
    assert trace.arrival_time[0] == 0.0 and 3500 < trace.arrival_time[-1] < 3600  # one hour
    assert np.all(np.diff(trace.arrival_time) >= 0)


@pytest.mark.skipif(not AZURE_CONV.is_file(), reason="needs ../shared/traces/azure-conv-2023.csv")
def test_azure_form_of_the_same_trace_matches(tmp_path):
    """Rewrite the first 500 rows in Azure's own form (date-times); both forms give the same requests."""
    vidur = read_trace(AZURE_CONV, limit=500)
    start = np.datetime64("2023-11-16T18:15:46.6805900", "ns")
    stamps = start + (vidur.arrival_time * 1e9).astype("timedelta64[ns]")
    rows = [f"{str(s).replace('T', ' ')[:27]},{p},{o}" for s, p, o in zip(stamps, vidur.num_prompt_tokens, vidur.num_output_tokens)]
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    azure = read_trace(path)
    assert azure.form == "azure"
    assert np.allclose(azure.arrival_time, vidur.arrival_time, atol=2e-6)  # microsecond-truncated date-times
    assert np.array_equal(azure.num_prompt_tokens, vidur.num_prompt_tokens)
    assert np.array_equal(azure.num_output_tokens, vidur.num_output_tokens)


@pytest.mark.parametrize(
    "text, message",
    [
        # counts past MAX_TOKENS overflowed int64 (a traceback), in the fast (CSV) and slow (JSONL) paths
        (VIDUR + "5.0,1e30,3\n", "line 6, column num_prefill_tokens: expected a whole number from 1 to 16,777,216, got '1e30'"),
        (JSONL + '{"arrival_time": 1, "prompt_tokens": 1e30, "output_tokens": 1}\n', "line 5, column prompt_tokens: expected a whole number"),
        (VIDUR + "5.0,10,16777217\n", "line 6, column num_decode_tokens: expected a whole number from 0 to 16,777,216"),
    ],
)
def test_counts_beyond_the_longest_request_are_rejected(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(KvsimError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_time_scale_that_overflows_the_arrivals_is_an_error(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n1e15,10,1\n")
    with pytest.raises(KvsimError, match="time_scale 1e\\+300 overflows the arrival times"):
        read_trace(path, time_scale=1e300)


def test_arrivals_past_1e9_s_are_an_error(tmp_path):
    # 2e15 s was replayed, its TTFTs and TPOTs lost in the arrival times' resolution (0.25 s there)
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n1e15,10,1\n")
    with pytest.raises(KvsimError) as err:
        read_trace(path, time_scale=2.0)
    assert str(err.value) == (f"{path}: the last arrival is 2e+15 s after the first x time_scale 2, past 1e+09 s, the "
                              "latest arrival kvsim replays (beyond it a double does not resolve a step's time)")
    assert read_trace(path, limit=1).arrival_time.tolist() == [0.0]  # the requests replayed are the ones held to it
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n5e8,10,1\n")
    assert read_trace(path, time_scale=2.0).arrival_time.tolist() == [0.0, 1e9]
    with pytest.raises(KvsimError, match="the last arrival is 1.5e\\+09 s after the first x time_scale 3, past 1e\\+09 s"):
        read_trace(path, time_scale=3.0)


def test_blank_lines_above_the_header_are_skipped_and_lines_still_counted(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("\n\r\n" + VIDUR + "5.0,abc,3\n")
    with pytest.raises(KvsimError, match="line 8, column num_prefill_tokens"):
        read_trace(path)
    path.write_text("\n\n" + VIDUR)
    trace = read_trace(path)
    assert trace.form == "vidur" and trace.num_prompt_tokens.tolist() == [374, 396, 91, 879]


def test_arrivals_count_from_the_first_request_in_every_form(tmp_path):
    """Epoch seconds in a JSONL (or a slice from the middle of a day) started the clock at 1.7e9 s: throughput
    was over 54 years, and at that magnitude a float resolves only 2.4e-7 s."""
    start = 1_700_158_546.0
    epoch = tmp_path / "epoch.jsonl"
    epoch.write_text("".join(json.dumps({"arrival_time": start + t, "prompt_tokens": p, "output_tokens": o}) + "\n"
                             for t, p, o in [(0.0, 374, 44), (0.25, 396, 109), (4.5, 879, 55), (1.5, 91, 16)]))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(JSONL)
    assert read_trace(epoch).arrival_time.tolist() == read_trace(plain).arrival_time.tolist() == [0.0, 0.25, 1.5, 4.5]
    later = tmp_path / "later.csv"
    later.write_text(VIDUR.replace("\n0.0,", "\n100.0,").replace("\n0.25,", "\n100.25,").replace("\n4.5,", "\n104.5,")
                     .replace("\n1.5,", "\n101.5,"))
    assert read_trace(later, time_scale=2.0).arrival_time.tolist() == [0.0, 0.5, 3.0, 9.0]


@pytest.mark.parametrize(
    "stamps",
    [
        ("2023-11-16T18:15:46.123Z", "2023-11-16T18:15:47Z"),  # time zones: the row-by-row path
        ("2023-11-16 18:15:46.1230000", "2023-11-16 18:15:47"),  # naive, 7 and 0 fractional digits: the numpy path
        ("2023-11-16 18:15:46.123+00:00", "2023-11-16 19:15:47+01:00"),
    ],
)
def test_azure_date_times_keep_their_microseconds(tmp_path, stamps):
    # Turned into float POSIX seconds before subtracting, 0.877 s came back as 0.877000093460083.
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},10,1\n" for s in stamps))
    assert read_trace(path).arrival_time.tolist() == [0.0, 0.877]


# --- Mooncake JSONL and BurstGPT CSV --------------------------------------------------------------------

MOONCAKE_DIR = SHARED / "traces" / "mooncake"


def mooncake_line(t_ms, prompt, output, ids):
    return json.dumps({"timestamp": t_ms, "input_length": prompt, "output_length": output, "hash_ids": ids}) + "\n"


def test_mooncake_form_ms_to_seconds_and_ids_follow_the_sort(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(mooncake_line(3000, 1100, 7, [0, 1, 2]) + mooncake_line(500, 512, 3, [0]) + mooncake_line(1000, 1024, 0, [0, 1]))
    trace = read_trace(path)
    assert trace.form == "mooncake"
    assert trace.arrival_time.tolist() == [0.0, 0.5, 2.5]  # ms from the first request, as seconds
    assert trace.num_prompt_tokens.tolist() == [512, 1024, 1100] and trace.num_output_tokens.tolist() == [3, 0, 7]
    assert trace.hash_ids == ((0,), (0, 1), (0, 1, 2))


@pytest.mark.parametrize("lines, message", [
    ([(0, 1100, 7, [0, 1])], "line 1, key hash_ids: expected 3 ids >= 0 (one per 512 prompt tokens)"),
    ([(0, 600, 7, [0, -1])], "line 1, key hash_ids: expected 2 ids"),
    ([(0, 0, 7, [])], "line 1, key input_length: expected a whole number from 1"),
    ([(-1, 5, 7, [0])], "line 1, key timestamp: expected milliseconds >= 0"),
    ([(0, 1024, 1, [0, 1]), (1, 1024, 1, [2, 1])], "line 2, key hash_ids: hash id 1 is block 1 after id 2 covering 512 tokens here, "
                                                   "but block 1 after id 0 covering 512 tokens at line 1 (ids must be chained)"),
    ([(0, 600, 1, [0, 1]), (1, 1024, 1, [0, 1])], "hash id 1 is block 1 after id 0 covering 512 tokens here, but block 1 after id 0 covering 88"),
    ([(0, 512, 1, [4]), (1, 1024, 1, [5, 4])], "hash id 4 is block 1 after id 5"),
    # past int64 was an OverflowError; past 2^40 an AssertionError in a replay's block keys
    ([(0, 100, 10, [2**63])], "line 1, key hash_ids: hash id 9223372036854775808 is past 1,099,511,627,775 (2^40 - 1"),
    ([(0, 100, 10, [5]), (1, 600, 10, [5, 2**40])], "line 2, key hash_ids: hash id 1099511627776 is past 1,099,511,627,775"),
])
def test_mooncake_bad_rows_and_unchained_ids(tmp_path, lines, message):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(mooncake_line(*line) for line in lines))
    with pytest.raises(KvsimError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_key_name_inside_a_value_or_a_nested_object_or_spaced_is_not_a_repeated_key(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"arrival_time": 0.5, "prompt_tokens": 10, "output_tokens": 2, "note": "\"prompt_tokens\"",
             "meta": {"prompt_tokens": 7}}, {"arrival_time": 0.0, "prompt_tokens": 20, "output_tokens": 3}]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text + '{"arrival_time" : 1.0, "prompt_tokens" : 30, "output_tokens" : 4}\n')  # no '":' at all
    trace = read_trace(path)
    assert trace.num_prompt_tokens.tolist() == [20, 10, 30]


@pytest.mark.parametrize("name, count, tokens", [("conversation_trace", 12_031, 144_793_823), ("synthetic_trace", 3_993, 61_194_628)])
def test_mooncake_traces(name, count, tokens):
    path = MOONCAKE_DIR / f"{name}.jsonl"
    if not path.is_file():
        pytest.skip("needs ../shared/traces/mooncake")
    trace = read_trace(path)
    assert len(trace) == count and trace.num_prompt_tokens.sum() == tokens and trace.form == "mooncake"


def test_shipped_mooncake_slices_are_the_traces_first_lines():
    from conftest import REPO

    for name in ("conversation", "synthetic"):
        shipped = (REPO / "workloads" / "traces" / f"mooncake-{name}-500.jsonl").read_text()
        trace = read_trace(REPO / "workloads" / "traces" / f"mooncake-{name}-500.jsonl")
        assert len(trace) == 500 and trace.form == "mooncake"
        full = MOONCAKE_DIR / f"{name}_trace.jsonl"
        if full.is_file():
            assert full.read_text().splitlines()[:500] == shipped.splitlines()


# Written by hand in BurstGPT's column layout (not rows of the real trace).
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "10,ChatGPT,300,20,320,Conversation log\n"
    "12,GPT-4,400,0,400,API log\n"
    "13.5,ChatGPT,50,70,120,API log\n"
    "20,GPT-4,900,100,1000,Conversation log\n"
    "21,ChatGPT,600,30,630,Conversation log\n"
)


@pytest.mark.parametrize("model, log_type, prompts, arrivals", [
    (None, None, [300, 400, 50, 900, 600], [0, 2, 3.5, 10, 11]),
    ("ChatGPT", None, [300, 50, 600], [0, 3.5, 11]),
    ("ChatGPT", "Conversation log", [300, 600], [0, 11]),
    (None, "API log", [400, 50], [0, 1.5]),
])
def test_burstgpt_filters_by_model_and_log_type(tmp_path, model, log_type, prompts, arrivals):
    path = tmp_path / "b.csv"
    path.write_text(BURSTGPT)
    trace = read_trace(path, model=model, log_type=log_type)
    assert trace.form == "burstgpt"
    assert trace.num_prompt_tokens.tolist() == prompts and trace.arrival_time.tolist() == arrivals


def test_burstgpt_filter_errors(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(BURSTGPT)
    with pytest.raises(KvsimError, match="trace has no requests with Model 'gpt-4'"):
        read_trace(path, model="gpt-4")  # values match exactly
    with pytest.raises(KvsimError, match="trace has no requests with Model 'GPT-4' and Log Type 'Chat'$"):
        read_trace(path, model="GPT-4", log_type="Chat")
    path.write_text(BURSTGPT.splitlines()[0] + "\n")
    with pytest.raises(KvsimError, match="trace has no requests$"):
        read_trace(path)
    path.write_text(BURSTGPT)
    vidur = tmp_path / "v.csv"
    vidur.write_text(VIDUR)
    with pytest.raises(KvsimError, match="model and log_type filter BurstGPT traces; this is a vidur trace"):
        read_trace(vidur, log_type="API log")
    path.write_text(BURSTGPT + "30,ChatGPT,0,5,5,API log\n")
    with pytest.raises(KvsimError, match="line 7, column Request tokens: expected a whole number from 1"):
        read_trace(path)


def test_burstgpt_filters_from_a_workload(tmp_path):
    from kvsim.workload.requests import generate_requests
    from kvsim.workload.spec import load_workload

    (tmp_path / "b.csv").write_text(BURSTGPT)
    (tmp_path / "w.yaml").write_text(
        "model: llama-3.1-8b\nhardware: h100-80gb\nkv_budget: 1GiB\nmax_model_len: 4096\n"
        "requests: {trace: {path: b.csv, model: GPT-4, log_type: Conversation log}}\nallocators: [{kind: paged}]\n")
    requests = generate_requests(load_workload(tmp_path / "w.yaml"))
    assert [(r.num_prompt_tokens, r.max_tokens) for r in requests] == [(900, 100)]


# --- token ids from Mooncake's hash ids -----------------------------------------------------------------

def test_token_ids_share_exactly_the_shared_ids_blocks():
    from kvsim.workload.requests import RequestSpec, make_token_ids

    a = make_token_ids(RequestSpec(0, 0.0, 1100, 5, hash_ids=(0, 1, 2)), seed=0)
    b = make_token_ids(RequestSpec(1, 0.0, 1300, 5, hash_ids=(0, 1, 3)), seed=0)
    c = make_token_ids(RequestSpec(2, 0.0, 1100, 5, hash_ids=(0, 1, 2)), seed=0)  # the same prompt again
    equal = a[:1100] == b[:1100]
    assert equal[:1024].all() and not equal[1024:].any()  # 2 shared ids: 1,024 tokens, not one more
    assert (a[:1100] == c[:1100]).all()  # a shared partial id shares its tokens too
    assert not (a[1100:] == c[1100:]).any()  # outputs are each request's own
    assert not (make_token_ids(RequestSpec(0, 0.0, 1100, 5, hash_ids=(0, 1, 2)), seed=1)[:512] == a[:512]).any()


def test_the_largest_hash_id_keys_its_blocks(tmp_path):
    from kvsim.workload.requests import make_block_keys, trace_requests
    from kvsim.workload.trace_mooncake import MAX_HASH_ID

    path = tmp_path / "m.jsonl"
    path.write_text(mooncake_line(0, 600, 1, [MAX_HASH_ID, 0]) + mooncake_line(1, 600, 1, [MAX_HASH_ID, 0]))
    a, b = trace_requests(read_trace(path))
    keys = make_block_keys(a, 16, 600)  # (37,) 32 blocks of id 2^40 - 1, then 5 of id 0
    assert len(set(keys.tolist())) == 37 and keys.tolist() == make_block_keys(b, 16, 600).tolist()
