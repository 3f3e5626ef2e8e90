"""Multi-turn rollouts with tools, on a scripted model: the token layout of a literal conversation
(hand-checked mask positions), malformed calls, tool errors, the turn and length limits, and the
batch that training gets from it."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from posttrain.driver.batch import RolloutBatch
from posttrain.data.dataset import encode_prompt
from posttrain.algorithms import place_on_last_token
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_tools

from helpers import Scripted

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
PROMPT = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class Tools:
    """A calculator that answers 4, or fails when told to."""

    def __init__(self, error=None):
        self.error, self.runs = error, []

    def run(self, calls, context):
        self.runs.append((calls, context))
        return [SimpleNamespace(name=c.name, content="error: boom" if self.error else "4", error=self.error)
                for c in calls]


def run(tok, script, settings=None, n=1, tools=None, logprobs=True):
    prompt_ids = encode_prompt(tok, PROMPT)
    gen = Scripted(tok, script)
    settings = dataclasses.replace(settings or MultiTurnSettings(max_response_length=1000),
                                   eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
    out, trajs = rollout_with_tools(gen, tok, [prompt_ids], [PROMPT],
                                    SamplingParams(max_new_tokens=512, n=n, logprobs=logprobs), tools or Tools(),
                                    [{"ground_truth": "4"}], settings)
    return out, trajs, gen, prompt_ids


def test_a_call_its_answer_and_the_final_turn_lay_out_as_the_chat_template_writes_them(tok):
    out, (t,), gen, prompt_ids = run(tok, [[CALL], ["It is 4."]])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = tok.encode(CALL, add_special_tokens=False) + [eos]
    between = tok.encode("\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    turn2 = tok.encode("It is 4.", add_special_tokens=False) + [eos]
    expected = turn1 + between + turn2
    assert out.response_ids[0].tolist() == expected
    # the mask, by hand: the model's tokens 1, the tool message and template tokens 0
    assert out.response_mask[0].tolist() == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert out.response_attention_mask[0].tolist() == [1] * len(expected)
    assert out.log_probs[0].tolist() == [-0.5] * len(turn1) + [0.0] * len(between) + [-0.5] * len(turn2)
    whole = tok.apply_chat_template(PROMPT + t.messages, tokenize=False)
    assert tok.decode(prompt_ids + expected) + "\n" == whole  # exactly the template's conversation
    assert gen.seen[1][0] == [prompt_ids + turn1 + between]  # turn 2 continues the whole conversation
    assert gen.seen[1][1].n == 1 and gen.seen[1][1].max_new_tokens == 1000 - len(turn1 + between)
    assert (t.turns, t.ended, t.answer, t.tool_errors, out.truncated.tolist()) == (2, "answer", "It is 4.", 0, [False])
    assert t.tool_calls == [{"name": "calculator", "arguments": {"expression": "2+2"}, "content": "4", "error": None}]
    assert (t.generated_tokens, t.tool_tokens) == (len(turn1) + len(turn2), len(between))

    batch = RolloutBatch.from_rollout(out, 1, ["x"], ["4"], [{}], [t.answer])
    p = out.prompt_ids.shape[1]
    assert batch.attention_mask[0, p:].tolist() == [1] * len(expected)  # training reads the tool tokens
    scores = place_on_last_token(torch.tensor([1.0]), batch.response_mask)
    assert scores[0].nonzero().flatten().tolist() == [len(expected) - 1]  # on the last generated token


def test_malformed_calls_and_tool_errors_become_tool_messages(tok):
    out, (t,), _, _ = run(tok, [["<tool_call>{not json</tool_call>"], [CALL], ["4"]], tools=Tools(error="error"))
    assert t.turns == 3 and t.malformed == 1 and t.tool_errors == 2 and t.ended == "answer"
    tool_msgs = [m["content"] for m in t.messages if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error: malformed tool call") and tool_msgs[1] == "error: boom"


def test_the_turn_limit_ends_after_an_assistant_turn(tok):
    out, (t,), gen, _ = run(tok, [[CALL], [CALL]], MultiTurnSettings(max_assistant_turns=2, max_response_length=1000))
    assert t.turns == 2 and t.ended == "max_turns" and len(t.tool_calls) == 1
    assert t.messages[-1]["role"] == "assistant" and int(out.response_mask[0, out.response_attention_mask[0].sum() - 1]) == 1
    assert not gen.calls and out.truncated.tolist() == [False]


def test_the_length_limit_counts_every_token_after_the_prompt(tok):
    limit = 150  # the call is 86 tokens of this character-level tokenizer, the tool message ~40
    out, (t,), gen, _ = run(tok, [[CALL], [None]], MultiTurnSettings(max_response_length=limit))
    assert t.ended == "length" and out.truncated.tolist() == [True]
    assert int(out.response_attention_mask[0].sum()) == limit  # the second turn stopped at the budget
    short = run(tok, [[CALL]], MultiTurnSettings(max_response_length=100))
    assert short[1][0].ended == "length" and short[1][0].turns == 1  # no room for the tool's answer and a turn


def test_samples_of_one_prompt_go_their_own_ways(tok):
    out, trajs, gen, _ = run(tok, [[CALL, "5"], ["4"]], n=2)
    assert [t.turns for t in trajs] == [2, 1] and [t.answer for t in trajs] == ["4", "5"]
    assert len(gen.seen[1][0]) == 1  # only the row that called a tool goes on
    assert out.response_ids.shape[0] == 2 and out.response_mask[1].sum() == len(tok.encode("5")) + 1


def test_a_training_run_with_tools_calls_them_and_trains_on_the_models_tokens_only(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """The embedded tiny model never writes a tool call, so its first turn is replaced by one (the tokens
    of a call to `add`); the rest is the real loop: the tool runs in its worker, the model answers in a
    second turn, the reward sees the trajectory, and the update trains on the generated tokens only."""
    from posttrain.driver.build import build_run
    from posttrain.config import load_config

    from helpers import run_overrides, write_prompts

    (tmp_path / "mytools.py").write_text('def add(a: int, b: int) -> int:\n    """Add two integers."""\n'
                                         '    return a + b\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    write_prompts(tmp_path, 8)
    cfg = load_config(None, run_overrides(
        tiny_model_dir, tmp_path, tmp_path / "run", "data.train_batch_size=4", "data.max_response_length=96",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2", "actor.lr=1e-3",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "reward.num_workers=0",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[mytools:add]",
        "rollout.multi_turn.max_assistant_turns=2", prompt_length=96))
    run = build_run(cfg)
    assert run.tools.names == ("add",)
    real = run.actor.generate
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def first_turn_calls(prompts, params):
        out = real(prompts, params)
        if params.n == 1:
            return out  # later turns: the model's own
        eos = run.multi_turn.eos_token_ids[0]
        ids = run.tokenizer.encode(call, add_special_tokens=False) + [eos]
        out.response_ids = torch.tensor([ids] * out.response_ids.shape[0])
        out.response_mask = torch.ones_like(out.response_ids)
        out.log_probs = None
        return out

    monkeypatch.setattr(run.actor, "generate", first_turn_calls)
    before = {k: v.clone() for k, v in run.actor.policy.state_dict().items()}
    from posttrain.driver.loop import rl_step

    m, batch = rl_step(run, [run.train_data[i] for i in range(4)])
    run.tools.close()
    run.rewards.close()
    assert m["multi_turn/tool_calls/mean"] == 1.0 and m["multi_turn/tool_errors"] == 0.0
    assert m["multi_turn/turns/mean"] == 2.0 and m["multi_turn/tool_use_ratio"] == 1.0
    assert all(info["tool_calls"][0]["content"] == "5" for info in batch.extra_info)
    p = batch.prompt_width
    seen, trained = batch.attention_mask[:, p:], batch.response_mask
    assert bool((seen.sum(-1) > trained.sum(-1)).all())  # every row has tool tokens, read but not trained on
    assert bool((batch.advantages[trained == 0] == 0).all())
    moved = max((run.actor.policy.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    assert moved > 0
    from posttrain.metrics.samples import sample_rows

    row = sample_rows(batch, run.tokenizer, 1)[0]  # samples.jsonl: the conversation, turn by turn
    assert row["turns"].startswith(f"[assistant] {call}\n[tool add] 5\n[assistant] ")


def test_eval_runs_multi_turn_with_tools(tmp_path, tiny_model_dir, capsys):
    from posttrain.cli import main
    from posttrain.data.schema import write_rows

    from helpers import embedded_rows

    write_rows(embedded_rows()[:3], tmp_path / "test.parquet")
    assert main(["eval", "--model", str(tiny_model_dir), "--data", str(tmp_path / "test.parquet"), "--tools",
                 "calculator", "--max-response-length", "16", "--reward-workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "(3 prompts x 1)" in out and out.splitlines()[-1].startswith("tool use")


def test_the_products_task_describes_the_calculator_and_holds_out_its_test_pairs(tmp_path):
    from posttrain.cli import main
    from posttrain.data.schema import read_rows
    from posttrain.rewards.arith import compute_score
    from posttrain.tools import load_tools, parse_tool_calls

    assert main(["preprocess", "products", "--output-dir", str(tmp_path), "--num-train", "50", "--num-test",
                 "10"]) == 0
    train, test = read_rows([str(tmp_path / "train.parquet")]), read_rows([str(tmp_path / "test.parquet")])
    pairs = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train}
    assert len(train) == 50 and len(test) == 10 and not pairs & {(r["extra_info"]["a"], r["extra_info"]["b"])
                                                                    for r in test}
    row = train[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert 100 <= a <= 999 and row["prompt"][1]["content"] == f"What is {a} * {b}?"
    assert row["reward_model"]["ground_truth"] == str(a * b)
    calls, malformed = parse_tool_calls(row["prompt"][0]["content"])  # the example call in the system prompt works
    tools = load_tools(functions=["calculator"])
    assert not malformed and tools.run(calls, {})[0].content == "408"
    assert compute_score(f"It is {a * b}.", row["reward_model"]["ground_truth"]) == 1.0


def test_verls_gsm8k_multi_turn_keys_and_tool_config_load(tmp_path):
    """verl's examples/sglang_multiturn GSM8K run (its vLLM variant): its rollout keys and its tool
    config's shape; the answer checker reads the ground truth from extra_info.tools_kwargs."""
    from posttrain.config import load_config
    from posttrain.tools import load_tools, parse_tool_calls

    (tmp_path / "gsm8k_tool_config.yaml").write_text(
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n    tool_schema:\n"
        "      type: function\n      function:\n        name: calc_gsm8k_reward\n        description: Checks an answer.\n"
        "        parameters:\n          type: object\n          properties: {answer: {type: string}}\n"
        "          required: [answer]\n")
    with pytest.warns(UserWarning, match="rollout.trace"):
        cfg = load_config(None, ["model.path=/m", "actor_rollout_ref.rollout.name=vllm",
                                 "actor_rollout_ref.rollout.multi_turn.enable=True",
                                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
                                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/gsm8k_tool_config.yaml",
                                 "actor_rollout_ref.rollout.trace.token2text=False"])
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 5 and mt.format == "hermes"
    tools = load_tools(tool_config_path=mt.tool_config_path)
    try:
        calls, _ = parse_tool_calls('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}'
                                    '</tool_call>')
        row_info = {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}
        (right,) = tools.run(calls, {"ground_truth": "0", "extra_info": row_info})
        (wrong,) = tools.run(calls, {"ground_truth": "71", "extra_info": {}})
        assert "1.0" in right.content and right.error is None and "0.0" in wrong.content
    finally:
        tools.close()


def test_samples_and_the_report_show_a_conversation_turn_by_turn():
    from posttrain.metrics.samples import turns_text

    messages = [{"role": "assistant", "content": CALL}, {"role": "tool", "name": "calculator", "content": "4"},
                {"role": "assistant", "content": "It is 4."}]
    assert turns_text(messages) == f"[assistant] {CALL}\n[tool calculator] 4\n[assistant] It is 4."


def test_the_tool_warm_up_conversation_labels_only_the_assistants_turns():
    """The warm-up's conversation, laid out as a rollout lays it out: its labels are the call + EOS and
    the answer + EOS; the prompt, the tool's message and the template's tokens between turns are -100."""
    from posttrain.tiny.arith import ensure_tiny_model
    from posttrain.tiny.tools import conversation

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    ids, labels = conversation(tok, 347, 829)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 829"}}</tool_call>'
    assert tok.decode(ids) == ("<|im_start|>user\nWhat is 347 * 829?<|im_end|>\n<|im_start|>assistant\n" + call +
                               "<|im_end|>\n<|im_start|>tool\n287663<|im_end|>\n<|im_start|>assistant\n287663<|im_end|>")
    kept = [i for i, label in enumerate(labels) if label != -100]
    assert [labels[i] for i in kept] == [ids[i] for i in kept]
    prompt = len(tok.encode("<|im_start|>user\nWhat is 347 * 829?<|im_end|>\n<|im_start|>assistant\n"))
    first = list(range(prompt, prompt + len(call) + 1))  # the byte tokenizer: a token per character, and EOS
    between = len(tok.encode("\n<|im_start|>tool\n287663<|im_end|>\n<|im_start|>assistant\n"))
    second = list(range(first[-1] + 1 + between, len(ids)))  # "287663" and EOS
    assert kept == first + second and len(second) == 7
