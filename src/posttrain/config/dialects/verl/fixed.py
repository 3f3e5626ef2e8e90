"""verl's keys that posttrain takes at one value only, or names unused when set (keys.FIXED): its dataset class,
its FSDP strategy and hybrid-sharding size, the reference's and critic's own Ulysses sizes, its critic's checkpoint
count, FSDP1's buffer dtype, its fused kernels' backend, its reward managers and the reward model's own
tokenizer. Checked over all the run's layers before the merge
(resolve.py), in the words posttrain's validation used while they were its keys; none of them reaches the Config.

    unused = check(theirs, value, "train")   # ["actor.mixed_precision.buffer_dtype=bfloat16"], for the warning

posttrain sft reads the actor's keys, not the reference's or the critic's (they are RL settings there: named as
such by validate_sft).
"""

from __future__ import annotations

from posttrain.algorithms import NEEDS_CRITIC
from posttrain.config.checks import choice, need
from posttrain.config.dialects.verl.keys import FIXED
from posttrain.config.schema import DTYPE_SPELLINGS
from posttrain.text.lines import printable

STRATEGIES = ("fsdp", "fsdp2")  # FSDP2 either way
REWARD_MANAGERS = ("naive", "prime", "dapo", "batch")  # posttrain scores in worker processes whichever


def check(theirs: dict, value, command: str = "train") -> list[str]:
    """`theirs`: the keys of FIXED the run set (typed, a later layer winning); `value(key)`: posttrain's key as the
    merge will make it (resolve's view). -> the ones set for nothing, named in validation's warning line after
    keys.UNUSED's; ConfigError for a value posttrain cannot honour."""
    def get(key: str):
        return theirs.get(key, FIXED[key][1])

    path = get("data.custom_cls.path")
    need(not path, f"data.custom_cls.path={printable(path)}: a verl dataset class is not supported; posttrain reads "
         "parquet rows itself (prompt, data_source, reward_model.ground_truth): write the data in that layout "
         "(`posttrain preprocess` has examples) and leave data.custom_cls out")
    backend = get("model.fused_kernel_options.impl_backend")
    need(backend in (None, "torch", "triton"), f"model.fused_kernel_options.impl_backend={printable(backend)} is not "
         "one of: torch, triton")
    buffer = DTYPE_SPELLINGS.get(get("actor.mixed_precision.buffer_dtype"), get("actor.mixed_precision.buffer_dtype"))
    choice("actor.mixed_precision.buffer_dtype", buffer, ("float32", "bfloat16", "float16"))
    if command != "sft":  # posttrain sft names the reward's keys unused (validate_sft)
        choice("reward.reward_manager", get("reward.reward_manager"), REWARD_MANAGERS)
    for role in ("actor",) if command == "sft" else ("actor", "ref"):
        choice(f"{role}.strategy", get(f"{role}.strategy"), STRATEGIES)
        whole_sharding(f"{role}.fsdp_size", get(f"{role}.fsdp_size"))
    critic = value("algorithm.adv_estimator") in NEEDS_CRITIC
    kept, critics_kept = value("trainer.max_ckpt_to_keep"), get("trainer.max_critic_ckpt_to_keep")
    need(critics_kept in (None, kept) or not critic,
         f"trainer.max_critic_ckpt_to_keep={critics_kept}: a posttrain checkpoint holds the actor and the critic "
         f"together; set trainer.max_ckpt_to_keep (verl's max_actor_ckpt_to_keep, now {kept}) to the count you want "
         "for both")
    size = value("actor.ulysses_sequence_parallel_size")
    for key in ("ref.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"):
        own = get(key) or size  # null (or 0): the actor's
        need(own == size, f"{key}={own} differs from actor.ulysses_sequence_parallel_size={size}: posttrain's "
             "workers hold the actor, reference and critic together and split sequences one way for all of them; "
             "set them equal (or leave this one out)")
    if command != "sft":
        whole_sharding("critic.model.fsdp_size", get("critic.model.fsdp_size"))
    unused = ["trainer.max_critic_ckpt_to_keep (no critic)"] * (critics_kept is not None and not critic)
    unused += ["data.custom_cls.name (no path)"] * bool(get("data.custom_cls.name") and not path)
    unused += [f"actor.mixed_precision.buffer_dtype={buffer}"] * (buffer != "float32")
    if backend == "triton" or (backend and not value("model.use_fused_kernels")):
        unused.append(f"model.fused_kernel_options.impl_backend={backend}")  # posttrain's fused pass is torch code
    return unused


def whole_sharding(key: str, n: int) -> None:
    """verl's fsdp_config.fsdp_size: -1 (shard over every worker) only."""
    need(n == -1, f"{key}={n}: hybrid sharding is not supported, FSDP2 shards over every worker; "
         "set it to -1")
