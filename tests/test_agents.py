"""Agent programs through the OpenAI-compatible endpoint (posttrain.agents): the real `openai` client drives a tool
loop whose recorded tokens equal a tool rollout's, requests from many runs are sampled together, a failing agent
costs its own sample, the endpoint's refusals, and a few training steps whose samples are agent runs."""

import threading
from pathlib import Path

import openai
import pytest
import torch

from posttrain.agents import CompletionServer, rollout_with_agent
from posttrain.data.dataset import encode_prompt
from posttrain.models import load_model, load_tokenizer
from posttrain.models.shipped import tools_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_tools
from posttrain.tools import load_tools

import agent_examples
from helpers import read_metrics, small_run_overrides

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tools_engine():
    d = tools_model()
    tok = load_tokenizer(d)
    return HFRolloutEngine(load_model(d), [tok.eos_token_id], tok.pad_token_id, progress=False), tok


def serve(engine, tok, length=160, **kwargs):
    settings = MultiTurnSettings(max_assistant_turns=3, max_response_length=length, eos_token_ids=(tok.eos_token_id,))
    return CompletionServer(engine.generate, tok, settings,
                            defaults=SamplingParams(max_new_tokens=length, do_sample=False), **kwargs)


def rows_of(pairs):
    return [{"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "reward_model": {"ground_truth": str(a * b)},
             "extra_info": {}} for a, b in pairs]


def test_an_openai_client_agent_with_tools_is_served_the_tokens_a_tool_rollout_samples(tools_engine):
    """Greedy, the calculator agent's conversations through the endpoint and rollout_with_tools' over the same
    engine are the same tokens, masks and log-probs: the endpoint re-tokenizes nothing the model generated."""
    engine, tok = tools_engine
    rows, errors = rows_of([(347, 829), (12, 34), (5, 6)]), {}
    server = serve(engine, tok)
    try:
        out, trajs = rollout_with_agent(server, agent_examples.calculator_agent, rows, 1, 8, 120,
                                        [encode_prompt(tok, r["prompt"]) for r in rows], errors)
    finally:
        server.close()
    assert errors == {} and all(t.env_error is None for t in trajs)
    tools = load_tools(functions=["calculator"])
    settings = MultiTurnSettings(max_assistant_turns=3, max_response_length=160, eos_token_ids=(tok.eos_token_id,),
                                 template_kwargs={"tools": tools.schemas})
    ref, ref_trajs = rollout_with_tools(engine.generate, tok,
                                        [encode_prompt(tok, r["prompt"], {"tools": tools.schemas}) for r in rows],
                                        [r["prompt"] for r in rows],
                                        SamplingParams(max_new_tokens=160, do_sample=False, logprobs=True), tools,
                                        [{}] * 3, settings)
    assert any(t.tool_calls for t in ref_trajs)  # at least one conversation went through the calculator
    for i in range(3):
        a, b = out.response_attention_mask[i].bool(), ref.response_attention_mask[i].bool()
        assert out.response_ids[i][a].tolist() == ref.response_ids[i][b].tolist()
        assert out.response_mask[i][a].tolist() == ref.response_mask[i][b].tolist()
        # the endpoint's requests come one by one, the tool rollout's as a batch of 3: other shapes, other rounding
        assert torch.allclose(out.log_probs[i][a], ref.log_probs[i][b], rtol=0, atol=1e-5)
        assert out.prompt_ids[i][out.prompt_mask[i].bool()].tolist() == ref.prompt_ids[i][ref.prompt_mask[i].bool()].tolist()
        assert trajs[i].turns == ref_trajs[i].turns and trajs[i].answer == ref_trajs[i].answer


def test_many_runs_requests_are_sampled_together_and_a_follow_up_extends_the_sequence(tools_engine):
    engine, tok = tools_engine
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        return engine.generate(prompts, params)

    settings = MultiTurnSettings(max_response_length=40, eos_token_ids=(tok.eos_token_id,))
    server = CompletionServer(generate, tok, settings, batch_wait_s=30.0,  # it waits for all eight, not this long
                              defaults=SamplingParams(max_new_tokens=40, do_sample=False))
    try:
        out, trajs = rollout_with_agent(server, agent_examples.ask_twice, rows_of([(2, 3)] * 4), 2, 8, 120,
                                        [[1]] * 4, {})
    finally:
        server.close()
    assert calls == [8, 8]  # 8 runs, two requests each: sampled in two calls
    for i, t in enumerate(trajs):
        assert t.turns == 2 and t.env_error is None
        mask = out.response_mask[i][out.response_attention_mask[i].bool()].tolist()
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # answer, the user's "Check it." (0), answer


def test_a_failing_agent_fails_its_own_sample(tools_engine):
    engine, tok = tools_engine
    rows = [{**r, "extra_info": {"how": how}} for r, how in zip(rows_of([(2, 3)] * 5),
                                                                  ["raise", "junk", "hang", "silent", "fine"])]
    errors = {}
    server = serve(engine, tok, 20)
    try:
        out, trajs = rollout_with_agent(server, agent_examples.misbehaving, rows, 1, 8, 8.0, [[1, 2]] * 5, errors)
    finally:
        server.close()
    why = [t.env_error for t in trajs]
    assert "RuntimeError: the agent broke" in why[0] and "return a number or None" in why[1]
    assert "ran past 8 s" in why[2] and "made no request" in why[3] and why[4] is None
    assert errors == {"error": 3, "timeout": 1}
    assert out.prompt_ids[3][out.prompt_mask[3].bool()].tolist() == [1, 2]  # no request: the row's own prompt


def test_the_endpoint_refuses_what_it_cannot_serve(tools_engine):
    engine, tok = tools_engine
    server = serve(engine, tok, 20)
    key = server.open_session()
    try:
        llm = openai.OpenAI(base_url=server.base_url, api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="each agent run gets its own key"):
            llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        llm = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
            llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], stream=True)
        assert [m.id for m in llm.models.list()] == ["policy"]
    finally:
        server.close()
    assert not [t.name for t in server._threads if t.is_alive()]  # close() ends the listener and the dispatcher


def test_a_few_steps_whose_samples_are_agent_runs(tmp_path, data, trained_tiny_model_dir):
    """The tiny model through the endpoint, one question per run; the agent's own reward is the score."""
    from posttrain.driver.build import build_run
    from posttrain.config import load_config
    from posttrain.driver.loop import train

    mt = "rollout.multi_turn."
    run = build_run(load_config(None, small_run_overrides(
        trained_tiny_model_dir, data, tmp_path / "run", 2, f"{mt}enable=true",
        f"{mt}agent={HERE / 'agent_examples.py'}:one_shot", "trainer.save_freq=2")))
    before = {n: p.detach().clone() for n, p in run.actor.policy.named_parameters()}
    assert train(run)["steps"] == 2
    assert not any(torch.equal(before[n], p.detach()) for n, p in run.actor.policy.named_parameters())
    steps = [m for m in read_metrics(tmp_path / "run") if "critic/score/mean" in m]
    for m in steps:
        assert m["env/num_errors"] == 0, {k: v for k, v in m.items() if k.startswith(("env/", "agent/"))}
        assert m["critic/score/mean"] == pytest.approx(m["env/reward/mean"])
    assert not [t.name for t in threading.enumerate() if t.name.startswith("posttrain-openai")]  # ended with the run
