"""NeMo-RL's vision-language settings in a GRPO file: vLLM's room for images in a prompt, context parallelism
refused for a VLM file, and the VLM environments' reward functions as posttrain's reward.functions."""

from __future__ import annotations

from posttrain.config.dialects.nemo_rl.keys import VLM_ENV_KEYS
from posttrain.config.dialects.nemo_rl.policy import Leaves
from posttrain.errors import ConfigError
from posttrain.text.lines import clipped


def multimodal(f: Leaves, out: dict, origin: str) -> None:
    """vLLM's room for images in a prompt (policy.generation.vllm_cfg.limit_mm_per_prompt.image) -> its engine
    argument limit_mm_per_prompt; room for audio or video: refused (not supported yet). A VLM file
    (vlm_hf_data_processor) with context parallelism: refused, as NeMo-RL refuses it for VLMs (its DTensor worker
    asserts cp_size 1); posttrain's Ulysses would split an image's tokens from its pixels."""
    limits = "policy.generation.vllm_cfg.limit_mm_per_prompt."
    for kind in ("audio", "video"):  # a file that feeds them
        if f.get(limits + kind):
            raise ConfigError(f"{limits + kind}={clipped(f.get(limits + kind))} ({origin}): {kind} inputs are not "
                              "supported yet (images are: docs/vision.md)")
    if f.get(limits + "image") is not None:
        engine = dict(out.get("rollout.engine_kwargs") or {})
        engine["vllm"] = {**engine.get("vllm", {}), "limit_mm_per_prompt": {"image": f.get(limits + "image")}}
        out["rollout.engine_kwargs"] = engine
    vlm = any(f.flat.get(f"data.{s}.processor") == "vlm_hf_data_processor" for s in ("default", "train", "validation"))
    size = out.get("actor.ulysses_sequence_parallel_size") or 1
    if vlm and size > 1:
        raise ConfigError(f"policy.dtensor_cfg.context_parallel_size={size} ({origin}): context parallelism does not "
                          "take images (NeMo-RL refuses it for VLMs too); set it to 1")


def vlm_envs(f: Leaves, out: dict, origin: str, envs: set) -> set:
    """NeMo-RL's VLM environments (env.<name> with reward_functions) -> the ones read. The one the data names
    (data.train.env_name, data.validation.env_name, else data.default.env_name: NeMo-RL creates only those)
    scores every row: reward.functions = its reward_functions (name -> weight, or {weight, kwargs}), its num_workers
    reward.num_workers. One not named is not created by NeMo-RL either: read, unused."""
    vlm = {e for e in envs if f.has(f"env.{e}.reward_functions")}
    if not vlm:
        return vlm
    default = f.flat.get("data.default.env_name")
    named = {split: f.flat.get(f"data.{split}.env_name", default) for split in ("train", "validation")}
    if not f.flat.get("data.validation.dataset_name") and not f.flat.get("data.validation.data_path"):
        named.pop("validation")  # no validation data of its own: no environment of its own
    used = sorted({e for e in named.values() if e in vlm})
    for e in sorted(vlm):
        for key in f.under(f"env.{e}"):
            leaf = key[len(f"env.{e}."):].split(".")[0]
            if leaf not in VLM_ENV_KEYS:
                raise ConfigError(f"NeMo-RL key {key!r} ({origin}) is not supported by posttrain: NeMo-RL's VLM "
                                  f"environment reads {', '.join(VLM_ENV_KEYS)}")
    if not used:
        return vlm
    functions = {e: reward_functions(f.flat.get(f"env.{e}.reward_functions"), e, origin) for e in used}
    if len(used) > 1 and functions[used[0]] != functions[used[1]]:
        raise ConfigError(f"data.train.env_name={named['train']} and data.validation.env_name={named['validation']} "
                          f"({origin}): posttrain scores training and validation with one reward, and these "
                          "environments' reward_functions differ; name one environment for both")
    for e in used:
        stops = f.flat.get(f"env.{e}.stop_strings")
        if stops not in (None, []):
            raise ConfigError(f"env.{e}.stop_strings={clipped(stops)} ({origin}) is not supported by posttrain "
                              "(responses end at the model's end of turn); set it to null")
    out["reward.functions"] = functions[used[0]]
    workers = f.flat.get(f"env.{used[0]}.num_workers")
    if workers is not None:
        out.setdefault("reward.num_workers", workers)
    for key in ("data.default.env_name", "data.train.env_name", "data.validation.env_name"):
        if f.flat.get(key) in vlm:
            f.get(key)
    return vlm


def reward_functions(items, env: str, origin: str) -> dict:
    """env.<name>.reward_functions ([{name, weight, kwargs?}, ...]) -> reward.functions (name -> weight, or
    {weight, kwargs}); checked as the run's validation checks it (rewards.vlm's specs and combine)."""
    from posttrain.rewards.vlm import combine, specs

    key = f"env.{env}.reward_functions"
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) and "name" in i for i in items):
        raise ConfigError(f"{key}={clipped(items)} ({origin}): a list of {{name: ..., weight: ...}} (kwargs optional)")
    out: dict = {}
    for item in items:
        if set(item) - {"name", "weight", "kwargs"}:
            raise ConfigError(f"{key} ({origin}): {item['name']} has keys other than name, weight and kwargs: "
                              f"{sorted(set(item) - {'name', 'weight', 'kwargs'})}")
        if item["name"] in out:
            raise ConfigError(f"{key} ({origin}) lists {item['name']} twice; list each function once")
        out[item["name"]] = ({"weight": item.get("weight"), "kwargs": dict(item["kwargs"])} if item.get("kwargs")
                             else item.get("weight"))
    try:
        combine(specs(out))
    except ValueError as e:
        raise ConfigError(f"{key} ({origin}): {e}") from None
    return out
