import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.data import dataset as dataset_module
from posttrain.data.dataset import PromptDataset, PromptSampler, encode_prompt
from posttrain.data.schema import read_rows, write_rows
from posttrain.errors import DataError

SPECIAL = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's ChatML layout, one token per character: easy to count by hand
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer(chat_template=CHATML) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built with `tokenizers` alone (no model files)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[2:])
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def row(content, truth="1", **extra):
    return {"data_source": "arith", "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {}, **extra}


# --- schema -----------------------------------------------------------------------------------


def test_read_rows_errors(tmp_path):
    with pytest.raises(DataError, match=r"'.*missing.parquet' does not exist; check data.train_files"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="'.*text.parquet' is not a readable parquet file"):
        read_rows(str(tmp_path / "text.parquet"))
    pq.write_table(pa.Table.from_pylist([{"data_source": "a", "reward_model": {"ground_truth": "1"}}]),
                   tmp_path / "noprompt.parquet")
    with pytest.raises(DataError, match=r"lacks column\(s\) prompt \(it has: data_source, reward_model\)"):
        read_rows(tmp_path / "noprompt.parquet")
    pq.write_table(pa.Table.from_pylist([{"data_source": "a", "prompt": [{"role": "user", "content": "x"}],
                                          "reward_model": {"style": "rule"}}]), tmp_path / "nogt.parquet")
    with pytest.raises(DataError, match=r"has no usable row: skipped 1 of 1 rows \(row 0: no reward_model.ground_truth\)"):
        read_rows(tmp_path / "nogt.parquet")
    with pytest.raises(DataError, match="no data files"):
        read_rows([])


def test_rows_round_trip_concatenate_and_default(tmp_path):
    write_rows([row("1+1=", "2"), row("2+2=", "4")], tmp_path / "a.parquet")
    countdown = {"data_source": "countdown", "prompt": [{"role": "user", "content": "24?"}], "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": {"target": 24, "numbers": [4, 6, 1]}},
                 "extra_info": {"split": "train", "index": 0}}
    write_rows([countdown], tmp_path / "sub" / "b.parquet")  # parent directory created
    # a verl-style file without the optional columns
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in row("3+3=", "6").items() if k in
                                          ("data_source", "prompt", "reward_model")}]), tmp_path / "c.parquet")
    rows = read_rows([tmp_path / "a.parquet", str(tmp_path / "sub" / "b.parquet"), tmp_path / "c.parquet"])
    assert rows == [row("1+1=", "2"), row("2+2=", "4"), countdown,
                    {**row("3+3=", "6"), "ability": "", "extra_info": {}}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "c.parquet", "sub"]  # no temp files left


def test_write_rows_refuses_mixed_types_and_nothing(tmp_path):
    with pytest.raises(DataError, match="do not share one schema"):
        write_rows([row("a", "1"), row("b", {"target": 1, "numbers": [1]})], tmp_path / "x.parquet")
    with pytest.raises(DataError, match="no rows"):
        write_rows([], tmp_path / "x.parquet")
    assert not list(tmp_path.iterdir())


def test_read_rows_with_another_prompt_key(tmp_path):
    r = row("q")
    r["question"] = r.pop("prompt")
    write_rows([r], tmp_path / "q.parquet")
    assert read_rows(tmp_path / "q.parquet", prompt_key="question")[0]["question"][0]["content"] == "q"
    with pytest.raises(DataError, match="lacks column.*prompt.*data.prompt_key"):
        read_rows(tmp_path / "q.parquet")


# --- PromptDataset ----------------------------------------------------------------------------


def test_chat_template_ids(tok):
    out = encode_prompt(tok, [{"role": "user", "content": "1+1="}])
    assert out == ids(tok, "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")
    assert type(out) is list and all(type(t) is int for t in out)
    # "<|im_start|>user\n" (6) + 4 + "<|im_end|>\n" (2) + "<|im_start|>assistant\n" (11) = 23 tokens
    assert len(out) == 23
    assert encode_prompt(tok, "plain text") == ids(tok, "plain text")


def test_filter_overlong_counts_and_logs(tok, capsys):
    rows = [row("1+1=", "2"), row("x" * 40), row("2+2=", "4", extra_info={"k": 1})]
    data = PromptDataset.build(rows, tok, max_prompt_length=30)
    assert len(data) == 2 and data.num_dropped == 1
    assert [(it.index, it.ground_truth, it.data_source, it.extra_info) for it in data.items] == [
        (0, "2", "arith", {}), (2, "4", "arith", {"k": 1})]
    assert data[1].messages == [{"role": "user", "content": "2+2="}] and len(data[1].prompt_ids) == 23
    assert "dropped 1 of 3 train prompts longer than max_prompt_length=30" in capsys.readouterr().err
    with pytest.raises(DataError, match="validation dataset is empty after dropping 3 prompts longer than "
                                        "data.max_prompt_length=5; raise data.max_prompt_length"):
        PromptDataset.build(rows, tok, max_prompt_length=5, name="validation")


def test_truncation_modes(tok):
    rows = [row("1+1="), row("x" * 40)]
    with pytest.raises(DataError, match="train row 1 has 59 prompt tokens, over data.max_prompt_length=30; "
                                        "raise data.max_prompt_length"):
        PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="error")
    full = ids(tok, "<|im_start|>user\n" + "x" * 40 + "<|im_end|>\n<|im_start|>assistant\n")
    left = PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="left")
    right = PromptDataset.build(rows, tok, 30, filter_overlong=False, truncation="right")
    assert left[1].prompt_ids == full[-30:] and right[1].prompt_ids == full[:30]
    assert left.num_dropped == 0 and left[0].prompt_ids == right[0].prompt_ids  # short prompts untouched
    with pytest.raises(DataError, match="data.truncation='middle' is not one of error, left, right"):
        PromptDataset.build(rows, tok, 30, truncation="middle")


def test_no_chat_template_warns_once(capsys, monkeypatch):
    monkeypatch.setattr(dataset_module, "_warned_no_template", set())
    base = char_tokenizer(chat_template=None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    data = PromptDataset.build([row("a"), {**row("b"), "prompt": msgs}], base, 50)
    assert data[0].prompt_ids == ids(base, "a") and data[1].prompt_ids == ids(base, "Be brief.\n1+1=")
    PromptDataset.build([row("c")], base, 50)
    assert capsys.readouterr().err.count("has no chat template") == 1


def test_bad_prompt_rows(tok):
    bad = row("x")
    bad["prompt"] = []
    with pytest.raises(DataError, match=r"train dataset has no usable row: .*\(row 0: prompt is an empty list"):
        PromptDataset.build([bad], tok, 30)
    with pytest.raises(DataError, match="no column 'question'; set data.prompt_key"):
        PromptDataset.build([row("x")], tok, 30, prompt_key="question")


# --- PromptSampler ----------------------------------------------------------------------------


def test_sampler_epochs_are_seeded_permutations():
    s = PromptSampler(10, 4, seed=1)
    assert s.steps_per_epoch == 2  # drop_last: the 2 left over wait for the next epoch's shuffle
    batches = [s.next_batch() for _ in range(6)]
    assert [e for e, _ in batches] == [0, 0, 1, 1, 2, 2]
    for epoch in range(3):
        seen = batches[2 * epoch][1] + batches[2 * epoch + 1][1]
        assert len(set(seen)) == 8 and set(seen) <= set(range(10))  # no repeats within an epoch
    assert batches[0][1] + batches[1][1] != batches[2][1] + batches[3][1]  # a new order each epoch
    again = PromptSampler(10, 4, seed=1)
    assert [again.next_batch() for _ in range(6)] == batches
    assert [PromptSampler(10, 4, seed=2).next_batch() for _ in range(2)] != batches[:2]


def test_sampler_state_round_trip():
    s = PromptSampler(10, 4, seed=3)
    for _ in range(3):
        s.next_batch()
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (1, 1)
    expected = [s.next_batch() for _ in range(3)]
    resumed = PromptSampler(10, 4, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(3)] == expected
    with pytest.raises(DataError, match="num_items=10, this run has 12; resume with the same data"):
        PromptSampler(12, 4, seed=3).load_state_dict(state)


def test_sampler_options_and_errors():
    s = PromptSampler(5, 2, shuffle=False)
    assert [s.next_batch() for _ in range(3)] == [(0, [0, 1]), (0, [2, 3]), (1, [0, 1])]
    s = PromptSampler(5, 2, shuffle=False, drop_last=False)
    assert s.steps_per_epoch == 3
    assert [s.next_batch() for _ in range(4)] == [(0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [0, 1])]
    with pytest.raises(DataError, match="data.train_batch_size=4 is larger than the 3 prompts.*lower "
                                        "data.train_batch_size"):
        PromptSampler(3, 4)


def test_apply_chat_template_kwargs_reach_the_template(tok):
    """verl's data.apply_chat_template_kwargs (Qwen3's enable_thinking=false): handed to the template."""
    from posttrain.config import load_config
    from posttrain.errors import ConfigError

    tok.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}/n{% endif %}")
    plain = PromptDataset.build([row("12")], tok, 30)
    cfg = load_config(None, ["+data.apply_chat_template_kwargs.enable_thinking=False"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    off = PromptDataset.build([row("12")], tok, 30, template_kwargs=cfg.data.apply_chat_template_kwargs)
    assert plain[0].prompt_ids == ids(tok, "12") and off[0].prompt_ids == ids(tok, "12/n")
    with pytest.raises(ConfigError, match="data.apply_chat_template_kwargs.tokenize: posttrain sets it"):
        load_config(None, ["data.apply_chat_template_kwargs.tokenize=false"])
