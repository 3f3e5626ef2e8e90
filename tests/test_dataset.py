import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.data.dataset import PromptDataset, PromptSampler
from posttrain.data.schema import read_rows, write_rows
from posttrain.errors import DataError
from posttrain.models import load_tokenizer


def row(content, truth="1"):
    return {"data_source": "arith", "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {}}


@pytest.fixture
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_read_rows_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable parquet"):
        read_rows(tmp_path / "text.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "a", "reward_model": {"ground_truth": "1"}}]),
                   tmp_path / "noprompt.parquet")
    with pytest.raises(DataError, match="lacks column.*prompt"):
        read_rows(tmp_path / "noprompt.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "a", "prompt": [{"role": "user", "content": "x"}],
                                          "reward_model": {"style": "rule"}}]), tmp_path / "nogt.parquet")
    with pytest.raises(DataError, match="ground_truth"):
        read_rows(tmp_path / "nogt.parquet")


def test_rows_round_trip_and_concatenate(tmp_path):
    write_rows([row("1+1="), row("2+2=", "4")], tmp_path / "a.parquet")
    write_rows([row("3+3=", "6")], tmp_path / "b.parquet")
    rows = read_rows([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "4", "6"]


def test_chat_template_and_length_filter(tok, capsys):
    rows = [row("1+1="), row("x" * 40), row("2+2=", "4")]
    ds = PromptDataset.build(rows, tok, max_prompt_length=30)
    # "<|im_start|>user\n" (6) + 4 + "<|im_end|>\n" (2) + "<|im_start|>assistant\n" (11) = 23 tokens
    assert len(ds) == 2 and ds.num_dropped == 1 and len(ds[0].prompt_ids) == 23
    assert ds[1].ground_truth == "4" and ds[1].index == 2
    assert "dropped 1 of 3 train prompts" in capsys.readouterr().err
    with pytest.raises(DataError, match="empty after dropping 3"):
        PromptDataset.build(rows, tok, max_prompt_length=5)


def test_truncation_modes(tok):
    rows = [row("x" * 40)]
    with pytest.raises(DataError, match="row 0 has 59 prompt tokens"):
        PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="error")
    left = PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="left")[0].prompt_ids
    right = PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="right")[0].prompt_ids
    assert len(left) == len(right) == 30 and left[-1] == ord("\n") and right[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_bad_prompt_rows(tok):
    bad = row("x")
    bad["prompt"] = []
    with pytest.raises(DataError, match="row 0"):
        PromptDataset.build([bad], tok, 30)


def test_sampler_epochs_and_state():
    s = PromptSampler(10, 4, seed=1)
    assert s.steps_per_epoch == 2
    batches = [s.next_batch() for _ in range(4)]
    assert [e for e, _ in batches] == [0, 0, 1, 1]
    first_epoch = batches[0][1] + batches[1][1]
    assert len(set(first_epoch)) == 8 and batches[0][1] != batches[2][1]
    again = PromptSampler(10, 4, seed=1)
    assert [again.next_batch() for _ in range(4)] == batches   # reproducible by seed
    resumed = PromptSampler(10, 4, seed=1)
    resumed.load_state_dict(PromptSampler(10, 4, seed=1).state_dict() | {"epoch": 1, "position": 1})
    assert resumed.next_batch() == batches[3]
    assert PromptSampler(10, 4, shuffle=False).next_batch() == (0, [0, 1, 2, 3])
    with pytest.raises(DataError, match="train_batch_size"):
        PromptSampler(3, 4)
