"""Ulysses sequence parallelism on 2 gloo processes: the all-to-all trades,
the attention, and log-probs, entropy and gradients equal to one process.
(The whole update with FSDP2 and the critic: tests/test_distributed.py.)"""

import json
import subprocess
import sys

import pytest

from posttrain.config import load_config
from posttrain.errors import ConfigError

TWO_RANKS = r"""
import copy, json, sys, types, torch, torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM
rank, rdzv = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
from posttrain.driver.batch import RolloutBatch
from posttrain.models.attention import grouped_attention, use_grouped_attention
from posttrain.rollout.base import RolloutOutput
from posttrain.training import ulysses as U
from posttrain.training.logprobs import PassOptions, log_probs_and_entropy
sp = U.SequenceParallel(dist.new_group([0, 1]), 2, rank)
torch.manual_seed(0)
out = {}
# the trades: [B, H, L/P, D] -> [B, H/P, L, D] -> back
q = torch.randn(2, 4, 6, 3)
mine = q[:, :, rank * 3:(rank + 1) * 3]
heads = U._seq_to_heads(mine, 2, sp.group)
out["heads"] = float((heads - q[:, rank * 2:(rank + 1) * 2]).abs().max())
out["roundtrip"] = float((U._heads_to_seq(heads, 2, sp.group) - mine).abs().max())
# the attention of half the positions (a left-padded row, 2 key/value heads) equals the whole's
k, v = torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 3)
pad = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
whole, _ = grouped_attention(module, q, k, v, U.full_mask(pad))
with U.sequence_parallel(sp, pad):
    half, _ = U.ulysses_attention(module, mine, k[:, :, rank * 3:(rank + 1) * 3], v[:, :, rank * 3:(rank + 1) * 3], None)
out["attention"] = float((half - whole[:, rank * 3:(rank + 1) * 3]).abs().max())
# a model with 1 key/value head (repeated to split), 7 input positions (padded to 8)
base = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=1))
use_grouped_attention(base)
model = copy.deepcopy(base)
U.use_ulysses(model, sp)
P = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
R = torch.tensor([[3, 4, 0], [5, 6, 7], [8, 0, 0]])
RM = (R > 0).long()
b = RolloutBatch.from_rollout(RolloutOutput(P, (P > 0).long(), R, RM), 1, ["s"] * 3, ["t"] * 3, [{}] * 3, ["a"] * 3)
grads, stats = [], []
for m, options in ((base, PassOptions(share_prompt=False)), (model, PassOptions(share_prompt=False, sp=sp))):
    lp, ent = log_probs_and_entropy(m, b, "cpu", 0.7, options, entropy_grad=True)
    ((lp + 0.5 * ent) * RM).sum().backward()
    grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    stats.append((lp.detach() * RM, ent.detach() * RM))
dist.all_reduce(grads[1])  # each worker holds its own positions' part: the group's parts add up
out["log_probs"] = float((stats[0][0] - stats[1][0]).abs().max())
out["entropy"] = float((stats[0][1] - stats[1][1]).abs().max())
out["grad"] = float((grads[0] - grads[1]).abs().max())
out["grad_size"] = float(grads[0].abs().max())
print(json.dumps(out), flush=True)
# without it, a rank can exit while gloo's threads still run: "terminate called without an active exception"
dist.destroy_process_group()
"""


def test_two_workers_split_positions_and_match_one_process(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), str(tmp_path / "rdzv")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["heads"] == 0.0 and r["roundtrip"] == 0.0
        assert r["attention"] < 1e-6 and r["log_probs"] < 1e-5 and r["entropy"] < 1e-5
        assert r["grad_size"] > 0.1 and r["grad"] < 1e-5


def test_verls_sequence_parallel_keys_load_and_misuse_is_one_line():
    c = load_config(None, ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                           "critic.ulysses_sequence_parallel_size=2", "data.train_batch_size=8",
                           "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "rollout.n=2"])
    assert c.actor.ulysses_sequence_parallel_size == 2  # the critic's: verl's key, checked equal by its dialect
    assert not hasattr(c.ref, "ulysses_sequence_parallel_size") and not hasattr(c.critic, "ulysses_sequence_parallel_size")
    for overrides, message in [
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
         "actor.ulysses_sequence_parallel_size=2 must divide the 1 workers"),
        (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
          "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"],
         "ref.ulysses_sequence_parallel_size=1 differs from actor.ulysses_sequence_parallel_size=2"),
        (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
          "actor_rollout_ref.model.use_fused_kernels=True"], "the fused pass does not split sequences yet"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
