"""``vllm-lens extract``'s input files: JSONL and CSV rows, keys, and every bad row named."""

import json

import numpy as np

from vllm_lens.cli.extract.prompts import _example, _plain, read_examples


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


def test_a_saved_dataset_directory_with_splits(tmp_path):
    import datasets
    import pytest

    rows = {"key": ["a", None, "c"], "prompt": ["first", "second", ""],
            "messages": [None, None, None]}
    chat = {"key": [None], "prompt": [None],
            "messages": [[{"role": "user", "content": "hi"}]]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict(chat)}).save_to_disk(tmp_path / "d")
    examples, bad = read_examples(tmp_path / "d", "train")
    assert [(e.key, e.prompt) for e in examples] == [("a", "first"), ("2", "second")]
    assert bad == ["row 3: needs a non-empty prompt (text) or messages (a list of "
                   "{role, content})"]
    (only,), bad = read_examples(tmp_path / "d", "test")
    assert only.key == "1" and only.messages == [{"role": "user", "content": "hi"}] and not bad
    with pytest.raises(SystemExit, match=r"has the splits \['train', 'test'\]; pick one"):
        read_examples(tmp_path / "d")
    with pytest.raises(SystemExit, match="has no split 'dev'"):
        read_examples(tmp_path / "d", "dev")
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "one")
    assert len(read_examples(tmp_path / "one")[0]) == 2
    with pytest.raises(SystemExit, match="holds one dataset, not splits"):
        read_examples(tmp_path / "one", "train")


def test_a_folder_of_data_files_goes_through_load_dataset(tmp_path):
    import pytest

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "x", "key": "k"}, {"prompt": "y", "key": "k"}]) + "\n")
    examples, bad = read_examples(folder)
    assert [e.key for e in examples] == ["k"] and bad == ["row 2: key 'k' appears twice"]
    with pytest.raises(SystemExit, match="applies to a dataset directory"):
        read_examples(folder / "part.jsonl", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="could not be read as a dataset"):
        read_examples(tmp_path / "empty")


def test_a_parquet_file_end_to_end(tmp_path):
    import pandas

    pandas.DataFrame({"key": ["a", None], "prompt": ["hello", None],
                      "messages": [None, [{"role": "user", "content": "hi"}]]}
                     ).to_parquet(tmp_path / "in.parquet")
    examples, bad = read_examples(tmp_path / "in.parquet")
    assert [(e.key, e.prompt) for e in examples] == [("a", "hello"), ("2", None)]
    assert examples[1].messages == [{"role": "user", "content": "hi"}] and not bad
