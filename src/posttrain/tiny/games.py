"""The embedded tiny model warmed up on number guessing: where the multi-turn game demonstration starts.

The shipped tiny model (tiny/arith.py) fine-tuned on whole games of posttrain.envs.games:GuessTheNumber
(1 to 16, 4 guesses), played by a guesser that keeps to the rules but not to a plan:

    user:       I am thinking of a number from 1 to 16. Guess it: ... You have 4 guesses.
    assistant:  11
    user:       lower
    assistant:  3
    user:       higher
    assistant:  7

each guess drawn uniformly from the numbers the answers so far still allow (it finds the number within 4
guesses 57% of the time; halving the range each time, 15 times in 16). The loss is on the assistant's tokens
only, the user's answers and the chat template's tokens between turns laid out by
rollout.multiturn.continuation_ids exactly as a rollout lays them out. It stops once `target_consistent` of
its sampled guesses on `dev_games` secrets lie inside the bounds the answers allow: the model then answers
with a number and keeps to the answers, but has no plan; GRPO in the game then raises how often it wins
(docs/environments.md).

Its weights ship inside the package (models/embedded_games/, checked by models/shipped.py), as the tool
model's do. `posttrain tiny-model --task games` prints its directory; `--rebuild` reruns this build.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from posttrain.tiny import arith

VERSION = "tiny-qwen2-v2-games-v1"
GAME = "posttrain.envs.games:GuessTheNumber"
GAME_KWARGS = {"low": 1, "high": 16, "tries": 4}
MAX_RESPONSE_TOKENS = 112  # 4 guesses (2-3 tokens each), 3 answers and the chat template's tokens around them: <= 94


@dataclass(frozen=True)
class GamesSpec:
    lr: float = 1e-3
    batch_size: int = 64
    games: int = 20000  # games of the uniform guesser to learn from
    target_consistent: float = 0.9  # sampled guesses inside the bounds, on the dev secrets
    max_steps: int = 2000
    eval_every: int = 25
    dev_games: int = 128


def uniform_game(secret: int, rng: random.Random, low: int = 1, high: int = 16, tries: int = 4) -> list[int]:
    """The guesses of a player who draws each guess uniformly from the numbers still allowed."""
    guesses = []
    while len(guesses) < tries:
        guesses.append(rng.randint(low, high))
        if guesses[-1] == secret:
            break
        low, high = (guesses[-1] + 1, high) if guesses[-1] < secret else (low, guesses[-1] - 1)
    return guesses


def game_row(secret: int) -> dict:
    """What the environment's reset sees of a `posttrain preprocess guess-number` row, and its first message."""
    from posttrain.envs.games import GuessTheNumber

    row = {"prompt": [{"role": "user", "content": "Guess the number"}], "reward_model": {"ground_truth": str(secret)},
           "data_source": "guess_number", "extra_info": {}}
    return {**row, "ask": GuessTheNumber(**GAME_KWARGS).reset(row)}


def conversation(tokenizer, secret: int, guesses: list[int]) -> tuple[list[int], list[int]]:
    """One game as (token ids, labels): labels -100 except on the assistant's turns."""
    from posttrain.data.dataset import encode_prompt
    from posttrain.rollout.multiturn import continuation_ids

    eos = tokenizer.eos_token_id
    messages = list(game_row(secret)["ask"])
    ids = encode_prompt(tokenizer, messages)
    labels = [-100] * len(ids)
    for k, g in enumerate(guesses):
        turn = tokenizer.encode(str(g), add_special_tokens=False) + [eos]
        ids, labels = ids + turn, labels + turn
        messages.append({"role": "assistant", "content": str(g)})
        if k + 1 < len(guesses):
            reply = [{"role": "user", "content": "higher" if g < secret else "lower"}]
            between = continuation_ids(tokenizer, messages, reply, {}, eos)
            ids, labels = ids + between, labels + [-100] * len(between)
            messages += reply
    return ids, labels


def game_scores(model, tokenizer, secrets: list[int], sample: bool) -> dict[str, float]:
    """The model plays GuessTheNumber once per secret (sampled at temperature 1, or greedy): the share won
    ("success"), the share of guesses inside the bounds ("consistent"), guesses per game ("guesses")."""
    from posttrain.envs.pool import InProcessEnvs
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.rollout.multiturn import MultiTurnSettings, rollout_with_env

    rows = [game_row(s) for s in secrets]
    engine = HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, progress=False)
    settings = MultiTurnSettings(max_assistant_turns=GAME_KWARGS["tries"], max_response_length=MAX_RESPONSE_TOKENS,
                                 eos_token_ids=(tokenizer.eos_token_id,))
    params = SamplingParams(max_new_tokens=MAX_RESPONSE_TOKENS, do_sample=sample, temperature=1.0)
    pool = InProcessEnvs(("class", GAME, dict(GAME_KWARGS)))
    _, trajectories, sessions = rollout_with_env(engine.generate, tokenizer, [r["prompt"] for r in rows], params,
                                                 pool, rows, settings)
    pool.finish(sessions)
    consistent = [i["consistent"] for t in trajectories for i in t.infos if "consistent" in i]
    return {"success": sum(sum(t.rewards or []) > 0 for t in trajectories) / len(secrets),
            "consistent": sum(consistent) / max(len(consistent), 1),
            "guesses": sum(t.turns for t in trajectories) / len(secrets)}


def build_games_model(output_dir: str | Path, seed: int = 0, spec: GamesSpec = GamesSpec(),
                      progress: bool = True) -> dict:
    """Fine-tune the shipped tiny model on the uniform guesser's games and save it to `output_dir`. -> metadata."""
    start = time.perf_counter()
    out = Path(output_dir)
    tokenizer, model = arith.warm_start(out, seed)
    rng = random.Random(seed)
    low, high = GAME_KWARGS["low"], GAME_KWARGS["high"]
    secrets = [rng.randint(low, high) for _ in range(spec.games)]
    rows = [conversation(tokenizer, s, uniform_game(s, rng, low, high, GAME_KWARGS["tries"])) for s in secrets]
    ids, attention, labels = arith.conversation_tensors(rows, tokenizer.pad_token_id)  # [N, L] each
    dev = [low + i % (high - low + 1) for i in range(spec.dev_games)]  # every secret equally often
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    step, dev_scores = 0, {"success": 0.0, "consistent": 0.0, "guesses": 0.0}
    while step < spec.max_steps:
        loss = arith.sft_step(model, opt, ids, attention, labels, spec.batch_size, gen)
        step += 1
        if step % spec.eval_every == 0:
            model.eval()
            torch.manual_seed(seed + step)
            dev_scores = game_scores(model, tokenizer, dev, sample=True)
            if progress:
                print(f"posttrain: warming up the tiny model on number guessing: step {step}, loss {loss:.3f}, "
                      f"guesses inside the bounds {dev_scores['consistent']:.2f} (target {spec.target_consistent}), "
                      f"games won {dev_scores['success']:.2f}", file=sys.stderr)
            if dev_scores["consistent"] >= spec.target_consistent:
                break
    model.eval()
    every = list(range(low, high + 1))
    greedy = game_scores(model, tokenizer, every, sample=False)
    model.save_pretrained(out, safe_serialization=True)
    meta = {"version": VERSION, "base": arith.VERSION, "seed": seed, "spec": asdict(spec), "game": GAME_KWARGS,
            "sft_steps": step, "dev_success": dev_scores["success"], "dev_consistent": dev_scores["consistent"],
            "greedy_success": greedy["success"], "greedy_consistent": greedy["consistent"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "posttrain_tiny.json").write_text(json.dumps(meta, indent=2))
    return meta
