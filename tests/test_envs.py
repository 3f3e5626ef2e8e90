"""Environments (posttrain.envs): conversations with an environment on a scripted model (the layout of a literal
guessing game, its per-turn rewards), verl's GSM8K interaction, what a misbehaving environment costs (its own
conversation only), the config's checks, and a few training steps scored by an environment."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from posttrain.config import load_config
from posttrain.data.dataset import encode_prompt
from posttrain.envs import EnvPool, InProcessEnvs, Step, as_step
from posttrain.envs.interactions import GSM8K, read_interaction_config
from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_env

from helpers import Scripted, read_metrics, small_run_overrides

HERE = Path(__file__).resolve().parent
GAME = f"{HERE / 'env_examples.py'}:GuessTheNumber"
BAD = f"{HERE / 'env_examples.py'}:Misbehaving"
PROMPT = [{"role": "user", "content": "Guess my number (1-9)."}]
ROW = {"prompt": PROMPT, "data_source": "game", "reward_model": {"ground_truth": "7"}, "extra_info": {}}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def converse(tok, script, pool, rows=(ROW,), n=1, **settings):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    s = dataclasses.replace(MultiTurnSettings(max_response_length=1000, **settings), eos_token_ids=(eos,))
    gen = Scripted(tok, script)
    out, trajs, sessions = rollout_with_env(gen, tok, [r["prompt"] for r in rows],
                                            SamplingParams(max_new_tokens=512, n=n, logprobs=True), pool, list(rows), s)
    pool.finish(sessions)
    return out, trajs, gen


def test_a_guessing_game_lays_its_hints_out_as_user_turns_and_keeps_each_turns_reward(tok):
    pool = EnvPool(("class", GAME, {"penalty": -0.1}), workers=1, timeout_s=10)
    try:
        out, (t,), gen = converse(tok, [["3"], ["9"], ["7"]], pool)
    finally:
        pool.close()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode(x, add_special_tokens=False) + [eos] for x in ("3", "9", "7")]
    hint = [tok.encode(f"\n<|im_start|>user\n{h}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
            for h in ("higher", "lower")]
    expected = turns[0] + hint[0] + turns[1] + hint[1] + turns[2]
    assert out.response_ids[0].tolist() == expected
    assert out.response_mask[0].tolist() == ([1] * len(turns[0]) + [0] * len(hint[0]) + [1] * len(turns[1])
                                             + [0] * len(hint[1]) + [1] * len(turns[2]))
    assert t.rewards == [-0.1, -0.1, 1.0] and t.ended == "done" and t.turns == 3
    assert [m["content"] for m in t.messages] == ["3", "higher", "9", "lower", "7"]
    assert t.infos == [{"guesses_right": 0}, {"guesses_right": 0}, {"guesses_right": 1}]
    prompt_ids = encode_prompt(tok, PROMPT)
    assert gen.seen[0][0] == [prompt_ids] and gen.seen[2][0] == [prompt_ids + expected[:-len(turns[2])]]


def test_the_turn_limits_end_a_game_after_the_environment_judged_the_last_turn(tok):
    pool = InProcessEnvs(("class", GAME, {}))
    _, (t,), _ = converse(tok, [["3"], ["4"]], pool, max_assistant_turns=2)
    assert (t.rewards, t.ended, t.turns) == ([0.0, 0.0], "max_turns", 2)
    _, (t,), _ = converse(tok, [["3"]], pool, max_user_turns=1)
    assert (t.rewards, t.ended) == ([0.0], "max_turns")
    _, (t,), _ = converse(tok, [[None]], pool)  # a turn cut off by the length limit is never judged
    assert (t.rewards, t.ended) == ([], "length")


def test_a_misbehaving_environment_fails_its_own_conversation_and_the_others_go_on(tok):
    """Each failure mode ends one conversation with a counted error; the worker survives what it can catch
    (the call's time limit by SIGALRM, MemoryError under its memory limit) and is replaced when it dies."""
    rows = [ROW] * 9
    pool = EnvPool(("class", BAD, {}), workers=2, timeout_s=1.0, memory_mb=1024)
    try:
        sessions = pool.reset(rows)
        steps = pool.step(sessions, ["raise", "hang", "spin", "hog", "nan", "junk", "fine", "fine", "fine"])
        why = [s.error for s in sessions]
        assert "RuntimeError: the environment broke" in why[0]
        assert "ran past 1 s" in why[1] and "ran past 1 s" in why[2]
        assert "out of memory (the limit is 1024 MB)" in why[3]
        assert "finite number" in why[4] and "'role': 'user' | 'tool' | 'system'" in why[5]
        assert why[6:] == [None] * 3 and [s.reward for s in steps[6:]] == [1.0] * 3
        assert all(s.done and s.reward == 0.0 for s in steps[:6])
        assert pool.errors == {"error": 4, "timeout": 2}
        sessions = pool.reset(rows[:2])  # worker 0 crashes: its conversation fails, worker 1's goes on
        steps = pool.step(sessions, ["crash", "fine"])
        assert sessions[0].error_kind == "crash" and "exit code 3" in sessions[0].error
        assert sessions[1].error is None and steps[1].reward == 1.0
        sessions = pool.reset(rows[:2])  # a new worker takes its place
        assert [s.reward for s in pool.step(sessions, ["fine", "fine"])] == [1.0, 1.0]
    finally:
        pool.close()


def test_a_failed_conversation_trains_nothing(tok):
    from posttrain.driver.env_side import EnvSide
    from posttrain.driver.sampling import sample
    from posttrain.data.dataset import PromptItem

    item = PromptItem(encode_prompt(tok, PROMPT), PROMPT, "game", "7", {})
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = type("E", (), {"generate": Scripted(tok, [["raise", "fine"]])})()
    env = EnvSide(InProcessEnvs(("class", BAD, {})))
    batch, trajs = sample(engine, tok, [item], SamplingParams(max_new_tokens=16, n=2), None,
                          MultiTurnSettings(eos_token_ids=(eos,)), env)
    assert trajs[0].env_error.startswith("RuntimeError") and trajs[1].env_error is None
    assert batch.response_mask[0].sum() == 0 and batch.response_mask[1].sum() > 0
    assert batch.extra_info[1]["turn_scores"] == [1.0] and batch.extra_info[0]["env_error"]


def test_step_results_in_gyms_shape_or_malformed():
    assert as_step(("hi", 1, False, {"k": 1})) == Step([{"role": "user", "content": "hi"}], 1.0, False, {"k": 1})
    assert as_step(([], 0, False, True, {})).done  # gymnasium's truncated ends it too
    with pytest.raises(ValueError, match="return a number"):
        as_step(([], "lots", True, {}))
    with pytest.raises(ValueError, match="posttrain.envs.Step or a tuple"):
        as_step(None)


def write(path, text):
    path.write_text(text)
    return str(path)


def test_verls_gsm8k_interaction_asks_again_until_the_answer_is_right(tok, tmp_path):
    config = write(tmp_path / "interaction.yaml",
                   f"interaction:\n  - name: gsm8k\n    class_name: {GSM8K}\n    config: {{}}\n")
    row = {**ROW, "extra_info": {"interaction_kwargs": {"name": "gsm8k", "query": "q", "ground_truth": "7"}}}
    pool = EnvPool(("interactions", read_interaction_config(config)), workers=1, timeout_s=10)
    try:
        _, (t,), _ = converse(tok, [["#### 5"], ["#### 7"]], pool, rows=[row])
    finally:
        pool.close()
    assert t.rewards == [0.0, 1.0] and t.ended == "done"
    assert t.messages[1] == {"role": "user", "content": "Your response is incorrect! You need to reflect on your "
                                                        "answer and try again."}


@pytest.mark.parametrize("text, message", [
    ("interaction: []", "has no `interaction:` list"),
    ("interaction:\n  - config: {}", "entry 0 has no class_name"),
    (f"interaction:\n  - class_name: {GSM8K}\n  - class_name: {GSM8K}", "two interactions are named 'gsm8k'"),
])
def test_a_bad_interaction_config_is_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        read_interaction_config(write(tmp_path / "i.yaml", text))
    with pytest.raises(ConfigError, match="does not exist"):
        read_interaction_config(str(tmp_path / "none.yaml"))


MT = "rollout.multi_turn."


@pytest.mark.parametrize("overrides, message", [
    ([f"{MT}enable=true"], "needs the other side of the conversation"),
    ([f"{MT}enable=true", f"{MT}environment=a:B", f"{MT}tools=[calculator]"], "tools and an environment"),
    ([f"{MT}enable=true", f"{MT}tools=[calculator]", f"{MT}reward_from=env"], "there is no environment"),
    ([f"{MT}enable=true", f"{MT}environment=a:B", f"{MT}reward_from=judge"], "reward_from"),
    ([f"{MT}enable=true", f"{MT}environment=a:B", f"{MT}max_user_turns=0"], "max_user_turns must be"),
])
def test_environment_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_few_steps_scored_by_an_environment(tmp_path, data, trained_tiny_model_dir):
    """The tiny model answers sums; the game says higher/lower until it is right (2 turns at most): the score is
    the environment's, the weights move, and the environment's metrics are logged."""
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train

    args = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "run", 2, f"{MT}enable=true",
                               f"{MT}environment={GAME}", f"{MT}max_assistant_turns=2", f"{MT}environment_workers=1",
                               "data.max_response_length=16", "trainer.save_freq=2")
    run = build_run(load_config(None, args))
    before = {n: p.detach().clone() for n, p in run.actor.policy.named_parameters()}
    summary = train(run)
    assert summary["steps"] == 2
    assert not any(torch.equal(before[n], p.detach()) for n, p in run.actor.policy.named_parameters())
    steps = [m for m in read_metrics(tmp_path / "run") if "critic/score/mean" in m]
    for m in steps:
        assert m["critic/score/mean"] == pytest.approx(m["env/reward/mean"])
        assert 1 <= m["env/turns/mean"] <= 2 and m["env/num_errors"] == 0
    val = [m for m in read_metrics(tmp_path / "run") if "val/score/mean" in m]
    assert val and all(m["val/score/mean"] == pytest.approx(m["val/env/reward/mean"]) for m in val)


def test_skyrl_gyms_multi_turn_gsm8k_runs_as_an_environment(tok):
    """SkyRL-gym's gsm8k_multi_turn through posttrain.envs.skyrl, in a worker process: its per-turn format score,
    its follow-up prompt, its end on the right answer and its episode metrics."""
    pytest.importorskip("skyrl_gym")
    pool = EnvPool(("class", "posttrain.envs.skyrl:SkyRLGym", {"id": "gsm8k_multi_turn", "max_turns": 3}),
                   workers=1, timeout_s=30)
    try:
        _, (t,), _ = converse(tok, [["#### 5"], ["#### 7"]], pool)
    finally:
        pool.close()
    assert t.rewards == [pytest.approx(0.2 / 3), 1.0] and t.ended == "done"
    assert "#### ANSWER" in t.messages[1]["content"] and t.messages[1]["role"] == "user"
    assert t.infos[-1] == {"steps": 2}


def test_the_built_in_games_hint_and_score_as_documented():
    from posttrain.envs.games import AnswerWithHints, GuessTheNumber

    env = AnswerWithHints(tries=3, discount=0.5)
    assert env.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "68"}}) == PROMPT
    assert env.step("60") == Step([{"role": "user", "content": "higher"}], 0.0, False, {"first_try": 0.0})
    assert env.step("no idea") == Step([{"role": "user", "content": "no number"}], 0.0, False, {})
    assert env.step("it is 68") == Step([], 0.25, True, {"solved": 1.0, "tries": 3})
    env.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "68"}})
    assert env.step("68").reward == 1.0
    env.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "68"}})
    assert [env.step("70").done for _ in range(3)] == [False, False, True]
    env.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "68"}})
    assert env.step("70-68").reward == 1.0  # the last integer as the arith reward reads it: 68, not -68

    game = GuessTheNumber(low=1, high=16, tries=2)
    ask = game.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "9"}})
    assert "from 1 to 16" in ask[0]["content"] and game.secret == 9
    assert game.step("8") == Step([{"role": "user", "content": "higher"}], 0.0, False, {"consistent": 1.0})
    assert game.step("10") == Step([], 0.0, True, {"consistent": 1.0, "solved": 0.0, "guesses": 2})
    # consistent: inside the bounds the answers so far allow (9 is higher than 8 and lower than 12: 9..11)
    game = GuessTheNumber(low=1, high=16, tries=6)
    game.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "9"}})
    steps = [game.step(g) for g in ("12", "8", "8", "no idea", "12", "11", "9")[:6]]
    assert [s.info["consistent"] for s in steps] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert [s.observation[0]["content"] if s.observation else None for s in steps] == \
        ["lower", "higher", "higher", "no number", "lower", None]
    assert steps[-1].done and steps[-1].info["solved"] == 0.0 and game.bounds == (9, 11)
    game.reset({"prompt": PROMPT, "reward_model": {"ground_truth": "9"}})
    assert game.bounds == (1, 16) and game.step("9") == Step([], 1.0, True, {"consistent": 1.0, "solved": 1.0,
                                                                              "guesses": 1})
    row = {"prompt": PROMPT, "reward_model": {"ground_truth": "68"}}  # out of range: drawn from the prompt
    drawn = set()
    for _ in range(3):
        g = GuessTheNumber()
        g.reset(row)
        drawn.add(g.secret)
    assert len(drawn) == 1 and 1 <= drawn.pop() <= 16  # the same game every time the row comes


def test_the_sliding_puzzle_plays_by_nemo_rls_rules():
    from posttrain.envs.sliding_puzzle import SlidingPuzzle, solved

    env = SlidingPuzzle(size=2, shuffle_moves=1, max_moves=3)  # one move away: 2x2, the blank moved once
    first = env.reset({"prompt": PROMPT, "extra_info": {"seed": 5}})
    assert "SLIDING PUZZLE" in first[0]["content"] and "<action>your_action</action>" in first[0]["content"]
    grid = [row[:] for row in env.grid]
    assert not solved(grid) and sum(row.count(0) for row in grid) == 1
    assert env.step("<action>view</action>").observation[0]["content"].endswith("No move made.</environment>\n")
    # the one move that solves it: slide the tile that sits where the blank belongs
    (r, c), = [(r, c) for r in range(2) for c in range(2) if grid[r][c] == 0]
    move = {(0, 1): "up", (1, 0): "left"}[(r, c)]
    assert env.step(f"thinking... <action>{move}</action>") == Step([], 1.0, True, {"solved": 1.0, "moves": 1})
    env.reset({"prompt": PROMPT, "extra_info": {"seed": 5}})
    assert env.grid == grid  # a seed is one puzzle
    assert env.step("no action").done  # NeMo-RL ends a turn without <action> as a failure
    env.reset({"prompt": PROMPT, "extra_info": {"seed": 5}})
    env.grid = [[1, 0], [3, 2]]  # by hand: "up" solves it; "right" and "left" move the blank back and forth
    said = [env.step(f"<action>{a}</action>").observation[0]["content"]
            for a in ("slide 2 1", "slide 3 3", "down", "right", "left", "right")]
    assert "Tile must be adjacent" in said[0] and "Row/column must be between 1 and 2" in said[1]
    assert "Cannot slide down" in said[2] and "Slid tile 1 right" in said[3] and "Slid tile 1 left" in said[4]
    last = env.step("<action>up</action>")  # three moves made: the game is over before this one
    assert last.done and last.reward == 0.0 and "Maximum moves (3) reached" in last.observation[0]["content"]


def test_a_run_with_verls_interaction_config_scores_with_the_reward_function(tmp_path, data, trained_tiny_model_dir):
    """verl's keys as its example passes them: the simulated user answers each turn, the reward function (arith,
    the rows' own) scores the last answer, and the interaction's turn scores are logged."""
    from posttrain.driver.build import build_run
    from posttrain.driver.loop import train

    config = write(tmp_path / "interaction.yaml", f"interaction:\n  - name: gsm8k\n    class_name: {GSM8K}\n")
    args = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "run", 1,
                               "actor_rollout_ref.rollout.multi_turn.enable=True",
                               f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={config}",
                               "actor_rollout_ref.rollout.multi_turn.max_user_turns=2", "data.max_response_length=48",
                               f"{MT}environment_workers=1", "trainer.test_freq=-1", "trainer.val_at_end=false")
    assert train(build_run(load_config(None, args)))["steps"] == 1
    (m,) = [x for x in read_metrics(tmp_path / "run") if "critic/score/mean" in x]
    assert m["env/num_errors"] == 0 and 1 <= m["env/turns/mean"] <= 3
    assert m["env/reward/mean"] == 0.0  # the tiny model writes no '#### answer': the interaction never says correct
    assert m["critic/score/mean"] > 0  # ... while the arith reward scores its last answers
