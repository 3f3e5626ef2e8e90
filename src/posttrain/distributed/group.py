"""A group of workers on a Ray cluster, called by verb.

`WorkerGroup` places `nnodes x per_node` workers (Ray actors running
`posttrain.worker.verbs.Worker`) in a placement group, one bundle per device,
joins them into one torch.distributed process group, and offers the same
verbs as a single `Worker`: it splits each batch over the workers, calls
the verb on all of them and gathers the answers. The driver stays the
single controller of the RL loop.

A worker that dies or raises stops the whole group at once with an error
naming the worker, its node and the cause; nothing waits on a dead peer.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch

from posttrain.distributed.balance import balanced_partition, minibatch_shards
from posttrain.distributed.cluster import describe_resources, import_ray
from posttrain.errors import PosttrainError
from posttrain.rollout.base import concat_rollouts, even_chunks
from posttrain.training.actor import loss_units
from posttrain.training.sft import learned_tokens
from posttrain.worker.spec import WorkerSpec

PLACEMENT_TIMEOUT_S = 120.0
RAY_DEBUGGER_ENV = ("RAY_DEBUG", "RAY_DEBUG_POST_MORTEM")  # Ray's debugger: docs/debugging.md
GRACE_S = 5.0  # after a failure, how long to wait for the other workers' errors (to find the root cause)


class WorkerFailed(PosttrainError):
    """A worker process died or raised; the run stopped."""


class WorkerGroup:
    def __init__(self, spec: WorkerSpec, nnodes: int, per_node: int, cpus_per_worker: int = 1,
                 resume_hint: str = ""):
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from posttrain.worker.verbs import Worker

        self.spec, self.world_size, self.resume_hint = spec, nnodes * per_node, resume_hint
        gpu = spec.device == "cuda"
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([bundle] * self.world_size, strategy="STRICT_PACK" if nnodes == 1 else "PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise WorkerFailed(
                f"the Ray cluster cannot place {self.world_size} workers with {bundle} each "
                f"({'on one node' if nnodes == 1 else f'over {nnodes} nodes'}; available: {describe_resources()}); "
                "lower trainer.n_gpus_per_node / trainer.nnodes / trainer.cpus_per_worker or add nodes")
        if spec.rollout.remote:  # asynchronous training: worker 0 places its rollout workers in this group's name
            spec.rollout.placement_group = f"posttrain-rollout-{uuid.uuid4().hex[:12]}"
        env = worker_env(spec.env, one_cpu_node=nnodes == 1 and not gpu)
        spec.env, spec.threads = env, spec.threads or cpus_per_worker
        remote = ray.remote(Worker)
        self.workers = [
            remote.options(
                num_cpus=cpus_per_worker, num_gpus=1 if gpu else 0, max_restarts=0, name=None,
                # asynchronous training: worker 0 answers the sampling thread's verbs (generate, engine_weights: its
                # rollout workers do the work) while the trainer's run (streamed: several batches' generates); the
                # trainer's collectives come one at a time
                max_concurrency=(8 if spec.rollout.piece_size else 2) if spec.rollout.remote else 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env} if env else None,
            ).remote(spec, rank=i, world_size=self.world_size, sharded=True)
            for i in range(self.world_size)
        ]
        self._rdzv_dir = None
        self.info = [{"rank": i} for i in range(self.world_size)]
        self.info = self._call_all("info")  # where each worker runs, for error messages
        self.info = self._call_all("setup", self._init_method(nnodes))
        self.pad_token_id = self.info[0]["pad_token_id"]

    def _init_method(self, nnodes: int) -> str:
        """One node: a rendezvous file (nothing listens on the network).
        Several: a TCP store on worker 0's node address."""
        if nnodes == 1:
            self._rdzv_dir = tempfile.mkdtemp(prefix="posttrain-rdzv-")
            return f"file://{self._rdzv_dir}/{uuid.uuid4().hex}"
        host, port = self._call([0], "free_address", [()])[0]
        return f"tcp://{host}:{port}"

    # ------------------------------------------------------------ the verbs

    def generate(self, prompts, params):
        """Prompts in consecutive equal chunks, one per worker (lengths are not
        known before sampling); the answers keep the prompts' order. With asynchronous training all go to
        worker 0, whose rollout workers share them out (rollout/pool.py)."""
        if self.spec.rollout.remote:
            return self._call([0], "generate", [(prompts, params)])[0]
        chunks = even_chunks(len(prompts), self.world_size)
        busy = [w for w, r in enumerate(chunks) if len(r) > 0]
        outs = self._call(busy, "generate", [([prompts[i] for i in chunks[w]], params) for w in busy])
        return concat_rollouts(outs, self.pad_token_id)

    def compute_log_probs(self, batch, which: str = "policy", teacher: str | None = None) -> torch.Tensor:
        return self._per_row("compute_log_probs", batch, which, teacher)

    def compute_values(self, batch) -> torch.Tensor:
        return self._per_row("compute_values", batch)

    def compute_teacher_topk(self, batch, k: int, teacher: str | None = None):
        return self._per_row("compute_teacher_topk", batch, k, teacher)

    @property
    def sp(self) -> int:
        """Workers that take the same rows: a Ulysses group (it splits their positions) or a tensor-parallel group
        (it splits each layer)."""
        return self.spec.sequence_parallel * self.spec.tensor_parallel

    def _per_row(self, verb: str, batch, *args):
        """A no-grad pass giving [N, R, ...] (or a tuple of such): rows balanced by tokens over the
        workers (over the sequence-parallel groups: each group's first answers). Rows that do not divide
        evenly (a teacher's share of a step's rows) are made up with copies of the last, whose results are
        dropped: every worker runs as many passes (a sharded model's collectives need all of them)."""
        count = len(batch)
        fill = -count % (self.world_size // self.sp)
        if fill:
            batch = batch.select(list(range(count)) + [count - 1] * fill)
        lengths = batch.attention_mask.sum(-1).tolist()
        parts = balanced_partition(lengths, self.world_size // self.sp)
        outs = self._call_all_with(verb, [(tensors_only(batch.select(parts[w // self.sp])), *args)
                                          for w in range(self.world_size)])[::self.sp]
        pairs = [(torch.tensor(rows), out) for rows, out in zip(parts, outs) if rows]

        def joined(pieces):  # each worker's rows back in the batch's order
            whole = torch.zeros((len(batch), *pieces[0][1].shape[1:]), dtype=pieces[0][1].dtype)
            for rows, piece in pieces:
                whole[rows] = piece
            return whole

        if isinstance(pairs[0][1], tuple):
            return tuple(joined([(rows, out[j]) for rows, out in pairs])[:count] for j in range(len(pairs[0][1])))
        return joined(pairs)[:count]

    def train_step(self, batch) -> dict[str, float]:
        return self._data_parallel("train_step", batch, self.spec.update.mini_batch_size,
                                   self.spec.update.loss_agg_mode)

    def update_critic(self, batch) -> dict[str, float]:
        c = self.spec.critic.update
        return self._data_parallel("update_critic", batch, c.mini_batch_size, c.loss_agg_mode)

    def _data_parallel(self, verb: str, batch, mini_batch_size: int, loss_agg_mode: str) -> dict[str, float]:
        """Each worker updates on its balanced share of every mini-batch; the
        mini-batches' loss denominators travel along so the summed gradients
        are those of one process."""
        lengths = batch.attention_mask.sum(-1).tolist()
        shards = minibatch_shards(lengths, mini_batch_size, self.world_size // self.sp)  # one per data-parallel group
        totals = [loss_units(m.response_mask, loss_agg_mode) for m in batch.split(mini_batch_size)]
        outs = self._call_all_with(verb, [(tensors_only(batch.select(shards[w // self.sp])), totals)
                                          for w in range(self.world_size)])
        # grad norm, lr and skips are the same on every worker; losses are averaged over workers
        return {k: sum(o[k] for o in outs) / len(outs) for k in outs[0]}

    def sft_step(self, batch: dict) -> dict[str, float]:
        """posttrain sft's update: each worker an equal, token-balanced share of the batch's rows (every worker
        runs as many passes: FSDP2 gathers with the others), the whole batch's learned-token count along, so
        the averaged gradient is that of one process."""
        groups = self.world_size // self.sp  # a sequence-parallel group's workers take the same rows
        parts = balanced_partition(batch["attention_mask"].sum(-1).tolist(), groups)
        total = learned_tokens(batch)
        outs = self._call_all_with("sft_step", [({k: v[parts[w // self.sp]] for k, v in batch.items()}, total)
                                                for w in range(self.world_size)])
        summed = ("train/loss", "train/learned_tokens")  # each group's part of the batch's
        return {k: sum(o[k] for o in outs[::self.sp]) if k in summed else sum(o[k] for o in outs) / len(outs)
                for k in outs[0]}

    def sft_loss(self, batch: dict) -> tuple[float, int]:
        """(summed -log p, learned tokens) of `batch`, its rows spread over the workers; rows that learn nothing
        fill it up to a multiple of the workers (each worker the same number of passes)."""
        n, groups = len(batch["input_ids"]), self.world_size // self.sp
        fill = -n % groups
        if fill:
            batch = {k: torch.cat([v, v[:1].expand(fill, -1)]) for k, v in batch.items()}
            batch["labels"][n:] = -100
        parts = balanced_partition(batch["attention_mask"].sum(-1).tolist(), groups)
        outs = self._call_all_with("sft_loss", [({k: v[parts[w // self.sp]] for k, v in batch.items()},)
                                                for w in range(self.world_size)])[::self.sp]
        return sum(o[0] for o in outs), sum(o[1] for o in outs)

    def sync_weights(self) -> None:
        self._call_all("sync_weights")

    def validation_weights(self, on: bool) -> None:
        self._call_all("validation_weights", on)

    def engine_weights(self, version: int, keep_older: bool = False) -> None:
        """Asynchronous training: worker 0's rollout workers sample with `version` of the weights next."""
        self._call([0], "engine_weights", [(version, keep_older)])

    def memory(self) -> dict[str, float]:
        """The largest peak over the workers, per quantity."""
        outs = self._call_all("memory")
        return {k: max(o[k] for o in outs) for k in outs[0]}

    def save_shards(self, path: str) -> None:
        self._call_all("save_shards", str(path))

    def snapshot(self, step: int, writer, trainer_state: dict, metrics: dict):
        """Workers write their shards now (into the writer's staging directory);
        the writer finishes the checkpoint, in the background with async_save."""
        from posttrain.checkpoint import shards_snapshot

        staging = writer.staging_dir(step)
        self.save_shards(str(staging))
        return shards_snapshot(step, staging, {}, trainer_state, metrics)

    def load_checkpoint(self, ckpt: str) -> bool:
        return all(self._call_all("load_checkpoint", str(ckpt)))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call_all("full_state_dict")[0]

    def generators(self) -> dict:
        return {}  # each worker saves its own random state with its shards

    def shutdown(self) -> None:
        ray = import_ray()
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        try:
            ray.util.remove_placement_group(self.pg)
        except Exception:
            pass
        if self.spec.rollout.placement_group:  # worker 0's rollout workers' (killed with it: their bundles stay)
            try:
                ray.util.remove_placement_group(ray.util.get_placement_group(self.spec.rollout.placement_group))
            except Exception:
                pass
        if self._rdzv_dir:
            import shutil

            shutil.rmtree(self._rdzv_dir, ignore_errors=True)

    # ------------------------------------------------------------ calling

    def _call_all(self, verb: str, *args):
        return self._call(range(self.world_size), verb, [args] * self.world_size)

    def _call_all_with(self, verb: str, per_worker_args: list[tuple]):
        return self._call(range(self.world_size), verb, per_worker_args)

    def _call(self, ranks, verb: str, per_worker_args: list[tuple]):
        """Call `verb` on the workers `ranks` with their own arguments; -> their
        answers in order. The first failure stops everything (see `_fail`)."""
        ray = import_ray()
        refs = [getattr(self.workers[r], verb).remote(*args) for r, args in zip(ranks, per_worker_args)]
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as first:
                self._fail(verb, rank_of[done[0]], first, pending, rank_of)
        return ray.get(refs)

    def _fail(self, verb, rank, first, pending, rank_of):
        """Collect the other workers' failures for a moment, pick the root
        cause (a dead worker over the peers it left stuck or disconnected),
        stop the group and raise WorkerFailed."""
        ray = import_ray()
        failures = [(rank, first)]
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S) if pending else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                failures.append((rank_of[ref], e))
        dead = [(r, e) for r, e in failures if isinstance(e, ray.exceptions.ActorDiedError)]
        r, error = (dead or failures)[0]
        self.shutdown()
        cause = getattr(error, "cause", None)
        if isinstance(cause, PosttrainError):
            raise type(cause)(f"worker {r}: {cause}") from None
        where = self.info[r] if r < len(self.info) else {}
        raise WorkerFailed(
            f"worker {r} (node {where.get('host', '?')}, pid {where.get('pid', '?')}) "
            f"{'died' if dead else 'failed'} during {verb}: {describe_failure(error)}. {self.resume_hint}"
        ) from None


def worker_env(env: dict, one_cpu_node: bool) -> dict:
    """The workers' environment variables (their runtime_env): `env` (WorkerSpec.env), gloo on loopback on
    one CPU node, and the driver's RAY_DEBUG / RAY_DEBUG_POST_MORTEM when set, so that a breakpoint() (or,
    post-mortem, an exception) in a worker reaches Ray's debugger on a cluster started without them."""
    out = {**{k: os.environ[k] for k in RAY_DEBUGGER_ENV if k in os.environ}, **env}
    if one_cpu_node:
        out.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: keep collectives on loopback
    return out


def tensors_only(batch):
    """The batch without its per-sequence Python lists (workers need tensors only)."""
    batch.data_source, batch.ground_truth, batch.extra_info, batch.response_text = [], [], [], []
    return batch


def describe_failure(error) -> str:
    """A Ray error in one line: the cause, not the whole traceback."""
    import re

    text = " ".join(str(error).split())
    if re.search(r"timed out|timeout", text, re.IGNORECASE) and re.search(r"gloo|nccl|collective|all_?gather|"
                                                                            r"reduce_?scatter|barrier", text, re.I):
        detail = re.search(r"((?:timed out|timeout)[^\[\]]{0,160})", text, re.IGNORECASE)
        return ("a collective did not finish within trainer.collective_timeout_s (a peer is stuck or gone"
                + (f": {detail.group(1).strip()[:200]}" if detail else "") + ")")
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    if exit_type:  # the worker process is gone
        detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text)
        reason = detail.group(1).strip() if detail else ""
        return (f"its process exited ({exit_type.group(1)}{': ' + reason[:200] if reason else ''}); it was killed "
                "(by the OOM killer or a signal) or its node was lost")
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]
