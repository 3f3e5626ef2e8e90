"""SFT examples (data/sft.py): the tokens, the loss mask and the errors, on the tiny model's byte tokenizer
(one token a byte, plus <|im_start|> and <|im_end|>), so every expected sequence is written out by hand."""

import pytest
import torch

from posttrain.data.sft import SFTDataSettings, collate, conversation_ids, load_examples
from posttrain.errors import DataError
from posttrain.models import load_tokenizer, shipped


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(shipped.embedded_model())


def parquet(tmp_path, rows, name="train.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def learned(tok, ex) -> str:
    return tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])


def test_a_single_turn_row_learns_the_response_and_the_end_of_its_turn(tok, tmp_path):
    path = parquet(tmp_path, [{"question": "1+2=", "answer": "3"}, {"question": "10+5=", "answer": "15"}])
    a, b = load_examples([path], tok, SFTDataSettings())
    assert tok.decode(a.input_ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>"
    assert learned(tok, a) == "3<|im_end|>" and sum(a.loss_mask) == 2
    assert a.loss_mask == [0] * (len(a.input_ids) - 2) + [1, 1]  # learned: the last two tokens, "3" and <|im_end|>
    assert learned(tok, b) == "15<|im_end|>"


def test_nested_keys_and_message_prompts_as_verl_reads_them(tok, tmp_path):
    """verl's data.prompt_key=extra_info data.prompt_dict_keys=[question] (its GSM8K SFT example); a prompt
    column holding chat messages is used as it is."""
    path = parquet(tmp_path, [{"extra_info": {"question": "2+2=", "answer": "4"}}])
    s = SFTDataSettings(prompt_key="extra_info", response_key="extra_info", prompt_dict_keys=("question",),
                        response_dict_keys=("answer",))
    (ex,) = load_examples(path, tok, s)
    assert tok.decode(ex.input_ids).endswith("user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>")
    path = parquet(tmp_path, [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                               "response": "R"}], "m.parquet")
    (ex,) = load_examples(path, tok, SFTDataSettings(prompt_key="prompt", response_key="response"))
    assert tok.decode(ex.input_ids) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                                        "<|im_start|>assistant\nR<|im_end|>")
    assert learned(tok, ex) == "R<|im_end|>"


def test_multi_turn_learns_every_assistant_turn_and_nothing_else(tok, tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]
    path = parquet(tmp_path, [{"messages": messages}])
    (ex,) = load_examples(path, tok, SFTDataSettings(multiturn=True))
    text = tok.decode(ex.input_ids)  # ends at the last assistant turn's end: the user after it teaches nothing
    assert text == tok.apply_chat_template(messages[:5], tokenize=False).rstrip("\n")
    assert learned(tok, ex) == "a1<|im_end|>a2<|im_end|>"
    spans = [i for i, m in enumerate(ex.loss_mask) if m]
    a1 = len(tok.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\n"))
    assert spans[:3] == [a1, a1 + 1, a1 + 2]  # "a", "1", <|im_end|>; the "\n" after it is context
    assert ex.input_ids[a1 + 3] == tok.encode("\n")[0] and ex.loss_mask[a1 + 3] == 0
    ids, mask = conversation_ids(tok, messages[:3])
    assert (ids, mask) == (ex.input_ids[:a1 + 3], ex.loss_mask[:a1 + 3])


def test_collate_pads_right_and_labels_only_learned_tokens(tok):
    from posttrain.data.sft import SFTExample

    batch = collate([SFTExample([5, 6, 7], [0, 1, 1]), SFTExample([8, 9], [0, 1])], pad_token_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7], [8, 9, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([[-100, 6, 7], [-100, 9, -100]]))


def test_truncation_keeps_the_side_asked_and_drops_rows_left_without_a_learned_token(tok, tmp_path, capsys):
    path = parquet(tmp_path, [{"question": "q" * 20, "answer": "abc"}, {"question": "q", "answer": "x"}])
    n = len(load_examples(path, tok, SFTDataSettings())[0].input_ids)
    with pytest.raises(DataError, match=rf"row 0 of '.*train.parquet' has {n} tokens, over data.max_length=24; "
                                        r"raise data.max_length, or set data.truncation=left"):
        load_examples(path, tok, SFTDataSettings(max_length=24))
    left = load_examples(path, tok, SFTDataSettings(max_length=24, truncation="left"))
    assert len(left[0].input_ids) == 24 and learned(tok, left[0]) == "abc<|im_end|>"
    right = load_examples(path, tok, SFTDataSettings(max_length=24, truncation="right"))
    assert len(right) == 1 and learned(tok, right[0]) == "x<|im_end|>"  # row 0 kept no answer token: left out
    assert "1 of 2 SFT rows kept no response token" in capsys.readouterr().err
    with pytest.raises(DataError, match="data.truncation must be one of error, left, right, got 'middle'"):
        load_examples(path, tok, SFTDataSettings(truncation="middle"))


def test_bad_rows_and_files_get_a_line_naming_the_fix(tok, tmp_path):
    def err(rows, settings=SFTDataSettings(), name="x.parquet"):
        with pytest.raises(DataError) as e:
            load_examples(parquet(tmp_path, rows, name), tok, settings)
        return str(e.value)

    msg = err([{"prompt": "q", "solution": "a"}])
    assert "row 0 of" in msg and "has no column 'question' (it has: prompt, solution); set data.prompt_key" in msg
    msg = err([{"messages": [{"role": "user", "content": "hi"}]}])
    assert "or data.multiturn.enable=true for a messages column" in msg
    msg = err([{"messages": [{"role": "user", "content": "hi"}]}], SFTDataSettings(multiturn=True))
    assert "has no assistant message: nothing to learn" in msg
    msg = err([{"messages": [{"role": "robot", "content": "hi"}]}], SFTDataSettings(multiturn=True))
    assert "needs a role (system, user, assistant, tool) and text content" in msg
    msg = err([{"question": "q", "answer": 3}])
    assert "the response ('answer') is a int, not text" in msg
    msg = err([{"extra_info": {"q": "x"}, "answer": "a"}], SFTDataSettings(prompt_key="extra_info",
                                                                          prompt_dict_keys=("question",)))
    assert "column 'extra_info' has no key 'question' at that depth (it has: q); fix data.prompt_dict_keys" in msg
    with pytest.raises(DataError, match="does not exist"):
        load_examples(tmp_path / "nope.parquet", tok, SFTDataSettings())
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a readable parquet file"):
        load_examples(tmp_path / "junk.parquet", tok, SFTDataSettings())


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    """A template that shows only the last assistant turn's text (as reasoning templates drop past thinking)
    would teach turns the model never sees: refused, with the way out."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
                       "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(DataError, match="renders earlier turns differently.*one row per assistant turn"):
        conversation_ids(t, messages)


def test_a_tokenizer_without_a_chat_template_learns_the_response_and_eos(tok, capsys):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = None
    ids, mask = conversation_ids(t, [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}])
    assert t.decode(ids) == "1+2=3<|im_end|>" and mask == [0, 0, 0, 0, 1, 1]
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        conversation_ids(t, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])


# NeMo-RL's examples/configs/sft.yaml template: it writes the answer's text and nothing after it
BARE_TEMPLATE = ("{% for message in messages %}{%- if message['role'] == 'system'  %}{{'Context: ' + "
                 "message['content'].strip()}}{%- elif message['role'] == 'user'  %}{{' Question: ' + "
                 "message['content'].strip() + ' Answer:'}}{%- elif message['role'] == 'assistant'  %}{{' ' + "
                 "message['content'].strip()}}{%- endif %}{% endfor %}")


def test_a_template_that_closes_no_assistant_turn_learns_the_eos_after_the_last(tok):
    """With no end-of-turn token after the assistant's text nothing would teach the model to stop: the EOS
    follows the last assistant turn and is learned (NeMo-RL's data.add_eos), not the earlier turns'."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = BARE_TEMPLATE
    messages = [{"role": "system", "content": "C"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2 "}]
    ids, mask = conversation_ids(t, messages)
    assert t.decode(ids) == "Context: C Question: q1 Answer: a1 Question: q2 Answer: a2<|im_end|>"
    spans = [t.decode([i]) for i, m in zip(ids, mask) if m]
    assert spans == [" ", "a", "1", " ", "a", "2", "<|im_end|>"]  # one token a byte, and the EOS
    assert ids[-1] == t.eos_token_id and mask[-1] == 1
    ids, mask = conversation_ids(t, messages[:3], only_last_turn=True)
    assert t.decode([i for i, m in zip(ids, mask) if m]) == " a1<|im_end|>"
    # a template that ends the turn itself (the tiny model's <|im_end|>) gets no second EOS
    ids, _ = conversation_ids(tok, messages)
    assert tok.decode(ids).endswith("assistant\na2 <|im_end|>") and ids.count(tok.eos_token_id) == 5


def test_only_last_turn_learns_the_last_assistant_turn_and_keeps_the_others_as_context(tok, tmp_path):
    messages = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    path = parquet(tmp_path, [{"messages": messages}])
    (every,) = load_examples(path, tok, SFTDataSettings(multiturn=True))
    (last,) = load_examples(path, tok, SFTDataSettings(multiturn=True, only_last_turn=True))
    assert last.input_ids == every.input_ids  # the same tokens ...
    assert learned(tok, every) == "a1<|im_end|>a2<|im_end|>"
    assert learned(tok, last) == "a2<|im_end|>"  # ... fewer learned
    assert last.loss_mask[-3:] == [1, 1, 1] and sum(last.loss_mask) == 3


def test_a_prompt_file_rewrites_a_single_turn_rows_prompt(tok, tmp_path):
    """data.prompt_file (NeMo-RL's data.default.prompt_file): its {} takes the row's question."""
    from posttrain.data.prompts import PromptTemplates

    path = parquet(tmp_path, [{"question": "1+2=", "answer": "3"}])
    (ex,) = load_examples(path, tok, SFTDataSettings(templates=PromptTemplates(prompt="Solve: {}\n")))
    assert tok.decode(ex.input_ids) == "<|im_start|>user\nSolve: 1+2=\n<|im_end|>\n<|im_start|>assistant\n3<|im_end|>"
    assert learned(tok, ex) == "3<|im_end|>"
