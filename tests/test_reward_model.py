"""A reward model (verl's reward_model.enable): a sequence-classification
model scores each (prompt, response) chat; alone its score is the reward,
with a custom function that function gets it as extra_info["rm_score"]."""

from pathlib import Path

import pytest
import torch

from posttrain.driver.build import build_run
from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.driver.loop import train
from posttrain.rewards.model import ModelRewards, RewardModel

from helpers import read_metrics, run_overrides


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, tiny_model_dir):
    """A tiny Qwen2 classifier with one label (random weights) and the tiny model's tokenizer."""
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from posttrain.models.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("rm")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    write_tokenizer(out)
    return out


def test_scores_are_the_last_tokens_logit_whatever_the_batching(classifier_dir):
    from transformers import AutoModelForSequenceClassification

    rm = RewardModel(str(classifier_dir), micro_batch_size=2)
    prompts = [[{"role": "user", "content": "2+2="}], "7+8=", [{"role": "user", "content": "12+30="}]]
    responses = ["4", "15, I think", "42"]
    got = rm.score(prompts, responses)  # 2 + 1 chats, padded to the longest of each pass (by length)
    unsorted = RewardModel(str(classifier_dir), micro_batch_size=2, remove_padding=False, param_offload=True)
    assert unsorted.score(prompts, responses) == pytest.approx(got, abs=1e-5)  # the same scores, other passes
    assert next(unsorted.model.parameters()).device.type == "cpu"  # offloaded: back in CPU memory after
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    for p, r, s in zip(prompts, responses, got):
        ids = rm.tokenizer(rm.chat_text(p, r), return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            assert model(input_ids=ids).logits[0, -1].item() == pytest.approx(s, abs=1e-5)
    assert rm.chat_text("7+8=", "15").endswith("<|im_start|>assistant\n15<|im_end|>\n")
    assert len(set(got)) == 3


def test_alone_the_model_is_the_reward_with_a_custom_function_it_is_an_input(classifier_dir):
    rm = RewardModel(str(classifier_dir))
    alone = ModelRewards(rm).score_batch(["x", "x"], ["4", ""], ["4", "4"], [{}, {}], prompts=["2+2=", "2+2="])
    assert alone.scores[1] == 0.0 and alone.scores[0] == alone.model_scores[0] == rm.score(["2+2="], ["4"])[0]

    class Pool:  # what the custom function's pool receives
        def score_batch(self, sources, responses, truths, infos, prompts=None):
            from posttrain.rewards.scoring import ScoreResult

            self.infos = infos
            return ScoreResult(scores=[i["rm_score"] + (r == t) for r, t, i in zip(responses, truths, infos)])

    pool = Pool()
    mixed = ModelRewards(rm, pool).score_batch(["x"], ["4"], ["4"], [{"k": 1}], prompts=["2+2="])
    assert pool.infos == [{"k": 1, "rm_score": alone.scores[0]}]
    assert mixed.scores == [pytest.approx(alone.scores[0] + 1)] and mixed.model_scores == [alone.scores[0]]


def test_a_run_with_verls_reward_model_keys_trains_on_the_models_scores(classifier_dir, tiny_model_dir, tmp_path):
    from posttrain.driver.build_data import embedded_data_files

    embedded = Path(embedded_data_files()[0]).parent  # its train.parquet
    cfg = load_config(None, run_overrides(
        tiny_model_dir, embedded, tmp_path / "run", "data.val_files=null", "data.train_batch_size=4",
        "data.max_response_length=6", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8", "rollout.n=2",
        "actor.lr=1e-3", "trainer.total_training_steps=2", "trainer.device=cpu", "reward_model.enable=True",
        f"reward_model.model.path={classifier_dir}", "reward_model.micro_batch_size_per_gpu=4"))
    from transformers import AutoModelForCausalLM

    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()}
    run = build_run(cfg)
    assert isinstance(run.rewards, ModelRewards)
    train(run)
    steps = [m for m in read_metrics(tmp_path / "run") if "critic/score/mean" in m]
    assert len(steps) == 2
    for m in steps:  # the reward is the model's score (empty responses: 0 on both sides)
        assert m["critic/score/mean"] == pytest.approx(m["reward/rm_score/mean"], abs=1e-6)
        assert m["reward/num_errors"] == 0
    after = run.actor.policy.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before)


def test_reward_model_config_errors():
    with pytest.raises(ConfigError, match="reward.model.enable=true needs reward.model.path"):
        load_config(None, ["model.path=/m", "reward_model.enable=True"])
    with pytest.raises(ConfigError, match="reward.reward_manager=limited is not one of"):
        load_config(None, ["model.path=/m", "reward_model.reward_manager=limited"])
    with pytest.warns(UserWarning, match="reward.model.use_reward_loop, reward.model.rollout: verl's settings"):
        load_config(None, ["model.path=/m", "reward_model.use_reward_loop=True", "reward_model.rollout.name=vllm"])
