"""Asynchronous training at cluster shape: a trainer group of FSDP2 workers on Ray beside rollout workers of their
own (rollout/pool.py, worker/rollout_actors.py), and a pool of rollout processes beside one trainer process, with a
dead rollout worker replaced."""

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

from posttrain.config import load_config
from posttrain.driver.build import build_run
from posttrain.driver.loop import train
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.pool import RolloutPool
from posttrain.rollout.remote import RemoteEngine, RolloutProcessError

from helpers import comparable, read_metrics, small_run_overrides

ASYNC = ("async_training.enable=true", "async_training.rollout_threads=1")


# ------------------------------------------------------------ the pool, over a toy engine


class Echo:
    """A toy engine: each prompt's response is its tokens + its worker's seed, after `delay_s` (time to kill it)."""

    def __init__(self, seed: int, delay_s: float = 0.0):
        self.seed, self.delay_s, self.generator = seed, delay_s, None
        self.weights = None

    def generate(self, prompts, params):
        time.sleep(self.delay_s)
        rows = [p + [self.seed, self.weights or 0] for p in prompts for _ in range(params.n)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return RolloutOutput(prompt_ids=torch.ones(len(rows), 1, dtype=torch.long),
                             prompt_mask=torch.ones(len(rows), 1, dtype=torch.long), response_ids=ids,
                             response_mask=mask)

    def load_weights(self, weights):
        self.weights = int(dict(weights)["w"].item())


def echo(seed: int, delay_s: float = 0.0) -> Echo:
    return Echo(seed, delay_s)


def local_pool(size: int, max_failures: int, delay_s: float = 0.0) -> RolloutPool:
    def spawn(i, attempt):
        return RemoteEngine(partial(echo, 100 + i + attempt * size, delay_s), name=f"rollout worker {i}")

    return RolloutPool(spawn, size, pad_token_id=0, max_failures=max_failures)


def responses(out: RolloutOutput) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(out.response_ids, out.response_mask)]


def test_the_pool_spreads_prompts_in_chunks_and_answers_in_their_order():
    pool = local_pool(2, 0)
    try:
        pool.load_weights([("w", torch.tensor(7))])
        out = pool.generate([[1], [2, 2], [3]], SamplingParams(max_new_tokens=2, n=2))
        # even_chunks(3, 2): prompts 0-1 to worker 0 (seed 100), prompt 2 to worker 1 (seed 101); all with w = 7
        assert responses(out) == [[1, 100, 7]] * 2 + [[2, 2, 100, 7]] * 2 + [[3, 101, 7]] * 2
    finally:
        pool.close()


def test_a_killed_rollout_worker_is_replaced_and_its_prompts_sampled_again():
    pool = local_pool(2, 1, delay_s=1.5)
    try:
        pool.load_weights([("w", torch.tensor(7))])
        victim = pool.workers[1].pid
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()  # mid-batch
        out = pool.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        # worker 0's answer kept; worker 1's prompt sampled again by its replacement (seed 101 + 2), which
        # loaded the weights the pool last loaded
        assert responses(out) == [[1, 100, 7], [2, 103, 7]]
        assert pool.failures == 1 and pool.workers[1].pid != victim
        # the second death is one too many: one line naming the worker and how it ended
        os.kill(pool.workers[1].pid, signal.SIGKILL)
        with pytest.raises(RolloutProcessError, match=r"^the rollout worker 1 process \(pid \d+\) was killed by "
                           r"signal 9 during generate \(rollout worker 1 of 2; 1 replacement of "
                           r"async_training.max_rollout_failures=1 already made\): the run stops here") as e:
            pool.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        assert "\n" not in str(e.value)
    finally:
        pool.close()


def test_a_closed_pool_replaces_no_worker():
    """A call that comes after the pool closed (a conversation's next turn, at a run's end) raises; no worker is
    started that nothing would close (a left-over process keeps the run from exiting)."""
    pool = local_pool(1, 3)
    pool.close()
    with pytest.raises(RolloutProcessError, match="the rollout workers were closed"):
        pool.generate([[1]], SamplingParams(max_new_tokens=2))
    assert pool.failures == 0


# ------------------------------------------------------------ streamed pieces


class Seeded(Echo):
    """A toy engine whose response is its prompt + (the piece's seed mod 1000, its weights): what it samples does
    not depend on the worker; which worker sampled each row is in the log-probs (its own seed)."""

    def generate(self, prompts, params):
        time.sleep(self.delay_s)
        rows = [p + [(self.seed if params.seed is None else params.seed) % 1000, self.weights or 0]
                for p in prompts for _ in range(params.n)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return RolloutOutput(prompt_ids=torch.ones(len(rows), 1, dtype=torch.long),
                             prompt_mask=torch.ones(len(rows), 1, dtype=torch.long), response_ids=ids,
                             response_mask=mask, log_probs=torch.full(ids.shape, float(self.seed)))


def seeded(seed: int, delay_s: float = 0.0) -> Seeded:
    return Seeded(seed, delay_s)


def streamed_pool(delays: list[float], max_failures: int = 0) -> RolloutPool:
    """len(delays) rollout processes taking one prompt at a time; worker i sleeps delays[i] per piece."""
    def spawn(i, attempt):
        return RemoteEngine(partial(seeded, 100 + i + attempt * len(delays), delays[i]), name=f"rollout worker {i}")

    pool = RolloutPool(spawn, len(delays), pad_token_id=0, max_failures=max_failures, piece_size=1)
    pool.weights_of = lambda version: iter([("w", torch.tensor(10 * version))])
    return pool


def test_streamed_pieces_go_to_whichever_worker_is_free_and_sample_alike_there():
    """8 prompts a piece each over a fast worker and a slow one: the fast one takes more pieces; every piece is
    sampled from its own seed with the call's version of the weights, loaded into the worker that takes it, so
    the answers are those of a pool of one worker, in prompt order."""
    from posttrain.rollout.base import mixed_seed

    prompts = [[i] for i in range(1, 9)]
    params = SamplingParams(max_new_tokens=2, seed=5, weights_version=3)
    expected = [[i, mixed_seed(5, i - 1) % 1000, 30] for i in range(1, 9)]
    pool, alone = streamed_pool([0.02, 0.8]), streamed_pool([0.0])
    try:
        out = pool.generate(prompts, params)
        assert responses(out) == expected
        takers = out.log_probs[:, 0].tolist()
        assert set(takers) == {100.0, 101.0} and takers.count(100.0) > takers.count(101.0), takers
        assert responses(alone.generate(prompts, params)) == expected
        # two calls at once, with versions of their own: each piece loads its call's version where it runs
        later = SamplingParams(max_new_tokens=2, seed=6, weights_version=4)
        with ThreadPoolExecutor(2) as ex:
            first, second = ex.map(lambda p: pool.generate(prompts[:4], p), [params, later])
        assert responses(first) == expected[:4]
        assert responses(second) == [[i, mixed_seed(6, i - 1) % 1000, 40] for i in range(1, 5)]
        assert pool.oldest_needed() == 4  # no piece needs version 3 any more: it may be let go
        # a call without a seed (validation) is cut in chunks, one per worker, as unstreamed
        pool.load_weights([("w", torch.tensor(7))])
        out = pool.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        assert out.log_probs[:, 0].tolist() == [100.0, 101.0]
    finally:
        pool.close()
        alone.close()


def test_a_streamed_piece_of_a_killed_worker_is_sampled_again_alike():
    """A worker killed while it samples a piece: the piece goes back to the queue, the replacement (or the other
    worker) samples it from the same seed, and the call's answers are those of a run without the death."""
    from posttrain.rollout.base import mixed_seed

    pool = streamed_pool([1.0, 1.0], max_failures=1)
    try:
        victim = pool.workers[1].pid
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()  # both are inside their first piece
        out = pool.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2, seed=9, weights_version=0))
        assert responses(out) == [[i, mixed_seed(9, i - 1) % 1000, 0] for i in (1, 2, 3)]
        assert pool.failures == 1
        deadline = time.monotonic() + 60  # worker 0 may have sampled every piece while the replacement started
        while pool.workers[1].pid == victim and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.workers[1].pid != victim
        os.kill(pool.workers[0].pid, signal.SIGKILL)  # one death too many: the call raises it, and so do later ones
        for _ in range(2):
            with pytest.raises(RolloutProcessError, match=r"^the rollout worker 0 process \(pid \d+\) was killed by "
                               r"signal 9 during generate \(rollout worker 0 of 2; 1 replacement"):
                pool.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2, seed=9, weights_version=0))
    finally:
        pool.close()


def test_a_streamed_run_is_its_seeds_whatever_its_rollout_workers_and_resumes_exactly(tmp_path, data,
                                                                                       tiny_model_dir):
    """Streamed, one update ahead, a piece a prompt: one rollout worker for 4 steps, and two stopped at step 2 and
    resumed to 4, are the same run (each piece sampled from its own seed with its batch's weights), and the
    second batch was sampled while the first was (overlap)."""
    from helpers import resume_overrides

    shape = ("trainer.test_freq=-1", *ASYNC, "async_training.max_trajectory_age_steps=1",
             "async_training.stream_samples=true", "async_training.stream_piece_size=1",
             "algorithm.rollout_correction.rollout_is=token")
    run(resume_overrides(tiny_model_dir, data, tmp_path / "one", 4, "trainer.save_freq=4", *shape))
    two = (*shape, "async_training.rollout_n_gpus_per_node=2")
    run(resume_overrides(tiny_model_dir, data, tmp_path / "two", 2, "trainer.save_freq=2", *two))
    assert run(resume_overrides(tiny_model_dir, data, tmp_path / "two", 4, "trainer.save_freq=4", *two))[
        "steps"] == 4
    one, two = comparable(tmp_path / "one"), comparable(tmp_path / "two")
    assert [m["step"] for m in two if "actor/pg_loss" in m] == [1, 2, 3, 4]
    assert [m["async/trajectory_age"] for m in one if "actor/pg_loss" in m] == [0, 1, 1, 1]
    two[2] = {k: v for k, v in two[2].items() if not k.startswith("val/")}  # the first half's validation at its end
    assert one == two
    # batch 2's version (0) exists from the start: its thread starts while batch 1's samples (2 at once)
    sampling = [m["perf/batches_sampling"] for m in read_metrics(tmp_path / "one") if "actor/pg_loss" in m]
    assert sampling[0] == 1 and max(sampling) == 2, sampling


# ------------------------------------------------------------ a trainer group beside rollout workers (Ray)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    from posttrain.distributed.cluster import connect

    connect(ray_cluster["address"])
    return ray_cluster


def run(args):
    return train(build_run(load_config(None, args)))


@pytest.mark.ray
def test_two_trainer_workers_beside_two_rollout_workers_at_k_0_are_the_synchronous_group(
        cluster, tmp_path, data, trained_tiny_model_dir, capfd):
    """Worker i of a synchronous group samples chunk i of the prompts with seed + i; rollout worker i does the
    same with the weights gathered from the trainer's shards: the same run, step by step, bit for bit."""
    group = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.save_freq=3",
             "trainer.test_freq=-1")
    sync = small_run_overrides(trained_tiny_model_dir, data, tmp_path / "sync", 3, *group)
    run(sync)
    capfd.readouterr()
    run([*sync, f"trainer.run_dir={tmp_path / 'async'}", *ASYNC, "async_training.max_trajectory_age_steps=0",
         "async_training.rollout_n_gpus_per_node=2"])
    said = capfd.readouterr().err
    trainers = set(re.findall(r"posttrain: worker \d: pid (\d+)", said))
    rollouts = set(re.findall(r"posttrain: rollout worker \d: pid (\d+)", said))
    assert len(trainers) == 2 and len(rollouts) == 2 and not trainers & rollouts, said[-3000:]
    import ray  # the run's end removed the rollout workers' placement group (it outlives worker 0, which made it)
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["name"].startswith("posttrain-rollout-") and pg["state"] != "REMOVED"]
    a = [{k: v for k, v in line.items() if not k.startswith("async/")} for line in comparable(tmp_path / "async")]
    assert a == comparable(tmp_path / "sync")
    assert [m["step"] for m in read_metrics(tmp_path / "async") if "actor/pg_loss" in m] == [1, 2, 3]


@pytest.mark.ray
def test_a_trainer_group_streams_to_rollout_actors_as_one_trainer_process_does(cluster, tmp_path, data,
                                                                               trained_tiny_model_dir):
    """Streamed, one update ahead: 2 trainer workers on Ray with 2 rollout actors (each piece's weights put in
    Ray's store once, loaded by the actor that takes it) train the run one trainer process with one rollout
    process trains, step by step, within float rounding (the trainer group's sums run in another order)."""
    shape = ("trainer.test_freq=-1", "trainer.save_freq=-1", *ASYNC, "async_training.max_trajectory_age_steps=1",
             "async_training.stream_samples=true", "async_training.stream_piece_size=1")
    run(small_run_overrides(trained_tiny_model_dir, data, tmp_path / "one", 3, *shape))
    run(small_run_overrides(trained_tiny_model_dir, data, tmp_path / "group", 3, *shape, "trainer.n_gpus_per_node=2",
                            f"trainer.ray_address={cluster['address']}", "async_training.rollout_n_gpus_per_node=2"))
    one, group = (comparable(tmp_path / d) for d in ("one", "group"))
    assert [m["step"] for m in group if "actor/pg_loss" in m] == [1, 2, 3]
    assert [m["async/trajectory_age"] for m in group if "actor/pg_loss" in m] == [0, 1, 1]
    for a, b in zip(one, group):
        assert a.keys() == b.keys()
        assert {k: a[k] for k in a if "response_length" in k} == {k: b[k] for k in b if "response_length" in k}
        assert all(a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5) for k in a), [
            (k, a[k], b[k]) for k in a if a[k] != pytest.approx(b[k], rel=1e-3, abs=1e-5)]


@pytest.mark.ray
def test_a_dead_rollout_actor_is_replaced_as_a_dead_process_is(cluster):
    """The same pool over Ray actors (worker/rollout_actors.py): the weights go through the object store once, an
    actor killed mid-batch is replaced, its chunk sampled again, the other chunk's answer kept."""
    import sys

    import ray

    from posttrain.worker.rollout_actors import RayEngine, RolloutActor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the toy engine travels by value
    actor = ray.remote(RolloutActor)

    def spawn(i, attempt):
        return RayEngine(actor.options(num_cpus=0, max_concurrency=2).remote(partial(echo, 100 + i + 2 * attempt, 1.5)),
                         f"rollout worker {i}")

    pool = RolloutPool(spawn, 2, pad_token_id=0, max_failures=1)
    try:
        pool.load_weights([("w", torch.tensor(7))])
        assert isinstance(pool._weights, ray.ObjectRef)
        victim = pool.workers[0]
        threading.Timer(0.5, ray.kill, (victim.actor,)).start()
        out = pool.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        assert responses(out) == [[1, 102, 7], [2, 101, 7]]
        assert pool.failures == 1 and pool.workers[0] is not victim
        ray.kill(pool.workers[1].actor)
        with pytest.raises(RolloutProcessError, match=r"^the rollout worker 1 \(pid \d+ on [^)]+\) died during "
                           r"generate.*\(rollout worker 1 of 2; 1 replacement"):
            pool.generate([[1], [2]], SamplingParams(max_new_tokens=2))
    finally:
        pool.close()


@pytest.mark.ray
def test_nemo_rls_non_colocated_example_runs_async_with_two_trainer_workers_and_one_rollout_worker(
        cluster, tmp_path, trained_tiny_model_dir, capfd):
    """grpo_math_8B_megatron_nixl.yaml (resolved, as tests/data/nemo_rl holds it; generation on GPUs of its own),
    with the FSDP2 switch and async GRPO one step ahead, on a cluster of 3 "GPUs" of which generation takes 1:
    2 trainer workers and 1 rollout worker, 3 steps of the tiny model on the arith task."""
    import json

    from posttrain.data.preprocess import arith

    from test_nemo_rl_config import FSDP2, examples

    train_file, test_file = arith.run(tmp_path / "data", num_train=32, num_test=8)
    path = tmp_path / "grpo_math_8B_megatron_nixl.yaml"
    path.write_text(json.dumps(examples()["configs"]["grpo_math_8B_megatron_nixl.yaml"]))  # JSON is YAML
    small = [*FSDP2, "cluster.gpus_per_node=3", "cluster.num_nodes=1",
             "policy.generation.colocated.resources.gpus_per_node=1",
             "policy.generation.colocated.resources.num_nodes=1",
             "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
             "loss_fn.use_importance_sampling_correction=true",
             "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=3",
             "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=8",
             "policy.max_total_sequence_length=64", "policy.generation.backend=hf", "policy.precision=float32",
             "grpo.val_period=0", "grpo.val_at_start=false", "checkpointing.enabled=false",
             f"logger.log_dir={tmp_path / 'logs'}", "logger.wandb_enabled=false", "logger.tensorboard_enabled=false",
             f"model.path={trained_tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
             f"trainer.ray_address={cluster['address']}", "trainer.device=cpu", "async_training.rollout_threads=1",
             f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]", "data.prompt_file=null",
             "data.max_response_length=3"]  # posttrain's keys mix in
    cfg = load_config(str(path), small)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 2)
    assert (cfg.async_training.rollout_nnodes, cfg.async_training.rollout_n_gpus_per_node) == (1, 1)
    assert cfg.async_training.enable and cfg.async_training.max_trajectory_age_steps == 1
    capfd.readouterr()
    assert train(build_run(cfg))["steps"] == 3
    said = capfd.readouterr().err
    assert len(set(re.findall(r"posttrain: worker \d: pid (\d+)", said))) == 2, said[-3000:]
    assert len(set(re.findall(r"posttrain: rollout worker \d: pid (\d+)", said))) == 1, said[-3000:]
    steps = [m for m in read_metrics(tmp_path / "run") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["async/trajectory_age"] for m in steps] == [0.0, 1.0, 1.0]  # one update ahead after the first


def test_the_cluster_model_overlaps_the_phases_on_gpus_of_their_own():
    """bench/async_cluster_model.py, by hand: gen 8 s and train 16 s on one GPU, 4 + 4 GPUs against 8 colocated."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from async_cluster_model import step_times

    t = step_times(8.0, 16.0, trainer=4, rollout=4, floor=0.0, sync_s=0.0)
    # colocated: 8/8 + 16/8 = 3 s; apart: max(8/4, 16/4) = 4 s, the rollout idle half the time
    assert (t["sync"], t["async"], t["speedup"], t["rollout idle"]) == (3.0, 4.0, 0.75, 0.5)
    # generation that cannot go below 3 s: colocated 3 + 2 = 5 s, apart max(3, 4 + 0.5) = 4.5 s
    t = step_times(8.0, 16.0, trainer=4, rollout=4, floor=3.0, sync_s=0.5)
    assert (t["sync"], t["async"]) == (5.0, 4.5) and t["trainer idle"] == 0.0


@pytest.mark.ray
def test_a_trainer_group_beside_rollout_workers_stops_and_resumes_exactly(cluster, tmp_path, data, tiny_model_dir):
    """2 trainer workers, 2 rollout workers, k = 2: the checkpoint at step 2 holds the batches sampled ahead and
    both rollout workers' sampling streams (worker 0's random state); the resumed run goes on as the whole one,
    the batch it samples itself (step 5's) included."""
    from helpers import resume_overrides

    shape = ("trainer.n_gpus_per_node=2", f"trainer.ray_address={cluster['address']}", "trainer.test_freq=-1",
             *ASYNC, "async_training.max_trajectory_age_steps=2", "async_training.rollout_n_gpus_per_node=2")
    run(resume_overrides(tiny_model_dir, data, tmp_path / "whole", 5, "trainer.save_freq=5", *shape))
    run(resume_overrides(tiny_model_dir, data, tmp_path / "split", 2, "trainer.save_freq=2", *shape))
    saved = torch.load(tmp_path / "split/checkpoints/global_step_2/rollouts_ahead.pt", weights_only=True)
    assert [b["step"] for b in saved["batches"]] == [3, 4]
    # steps 3-4 from the checkpoint's batches, step 5's sampled after the resume with the streams it restored
    assert run(resume_overrides(tiny_model_dir, data, tmp_path / "split", 5, "trainer.save_freq=5", *shape))[
        "steps"] == 5
    whole, split = comparable(tmp_path / "whole"), comparable(tmp_path / "split")
    assert [m["step"] for m in split if "actor/pg_loss" in m] == [1, 2, 3, 4, 5]
    split[2] = {k: v for k, v in split[2].items() if not k.startswith("val/")}  # the first half's validation at its end
    assert whole == split
