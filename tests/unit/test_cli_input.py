"""``vllm-lens extract``'s input files: JSONL and CSV rows, keys, and every bad row named."""

import json

import numpy as np

from vllm_lens.prompt_files import _example, _plain, read_examples


def test_jsonl_rows_keys_and_bad_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "a", "key": "k1"}), json.dumps({"prompt": "b"}), "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "key": 7}),
        "{broken", json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
        json.dumps({"messages": "not a chat"}), json.dumps([1, 2]),
        json.dumps({"prompt": "c", "key": "k1"}), json.dumps({"prompt": "d", "key": [1]}),
    ]) + "\n")
    examples, bad = read_examples(path)
    assert [(e.key, e.prompt) for e in examples] == [("k1", "a"), ("2", "b"), ("7", None)]
    assert examples[2].messages == [{"role": "user", "content": "hi"}]
    assert [b.split(":")[0] for b in bad] == ["line 5", "line 6", "line 7", "line 8", "line 9",
                                              "line 10"]
    assert "not both" in bad[1] and "appears twice" in bad[4] and "string or an integer" in bad[5]


def test_parquet_cells_are_read_as_json_would_give_them():
    row = {"key": float("nan"), "messages": np.array([{"role": "user", "content": "hi"}]),
           "prompt": None}
    example = _example(4, {k: _plain(v) for k, v in row.items()})
    assert example.key == "4" and example.messages == [{"role": "user", "content": "hi"}]
    assert _example(5, {"key": _plain(3.0), "prompt": "x"}).key == "3"


def test_csv_rows_with_a_header_and_json_messages(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('key,prompt,messages\nx,hello,\n,,"[{""role"": ""user"", '
                    '""content"": ""hi""}]"\ny,,\n')
    examples, bad = read_examples(path)
    assert [(e.key, e.prompt) for e in examples] == [("x", "hello"), ("3", None)]
    assert examples[1].messages == [{"role": "user", "content": "hi"}]
    assert bad == ["line 4: needs a non-empty prompt (text) or messages (a list of "
                   "{role, content})"]
