"""Prompts with images for the vLLM engine (Qwen2.5-VL).

posttrain's prompt ids are the processor's full call's: each image's placeholder already expanded into its run
of image tokens (`<|vision_start|><|image_pad|> x N<|vision_end|>`). vLLM 0.32 takes a tokens prompt with its
images as `multi_modal_data` and always expands the placeholders itself (`_apply_prompt_updates` in
vllm/multimodal/processing/processor.py replaces the first `<|image_pad|>` it finds for each image by the
image's N tokens): given an expanded run, it expands its first token again (measured: 6 image tokens became 11,
silently). So each run goes to vLLM collapsed back to one placeholder (`collapse_image_runs`), the images go as
the PIL images the HF processor saw, and vLLM's processor, the model directory's own image processor (its
preprocessor_config.json: the same resize), expands them again; the engine checks that vLLM's prompt ids are
posttrain's, token for token.

vLLM's CPU build here has no torchvision (PyPI's torchvision is built for CUDA and cannot load beside a CPU
torch: "operator torchvision::nms does not exist"), and vLLM's Qwen-VL code imports transformers' torchvision
image processor module and builds the processor with a video processor (torchvision again):
`images_without_torchvision` lets both run on transformers' PIL image processor with no video processor, for
images only, in this process and in each of vLLM's processes (started afresh, not forked) through posttrain's
vLLM plugin (`vllm_plugin`, the `vllm.general_plugins` entry point), as IMAGES_ENV tells them. Where
torchvision loads (vLLM's GPU build), nothing is changed.
"""

from __future__ import annotations

import os
import sys
import types

from posttrain.errors import ConfigError

IMAGES_ENV = "POSTTRAIN_VLLM_IMAGES"  # "1": the engine's model takes images (read by vLLM's worker processes)

# the model classes whose prompts `collapse_image_runs` knows (Qwen-VL's placeholders)
QWEN_VL_ARCHS = ("Qwen2_5_VLForConditionalGeneration",)


def _config(model_dir) -> dict:
    import json
    from pathlib import Path

    try:
        found = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def takes_images(model_dir) -> bool:
    """Whether `model_dir` holds a vision-language model (its config has a vision tower's config)."""
    return isinstance(_config(model_dir).get("vision_config"), dict)


def vllm_vision_family(model_dir) -> str | None:
    """None when vLLM's engine takes `model_dir`'s prompts with images, else the one-line reason it does not."""
    archs = _config(model_dir).get("architectures") or []
    if any(a in QWEN_VL_ARCHS for a in archs):
        return None
    return (f"rollout.name=vllm takes prompts with images for Qwen2.5-VL models only ({', '.join(archs) or 'this model'}"
            f" is not: its image placeholders are not collapsed for vLLM yet); set rollout.name=hf")


def image_token_id_of(model_dir) -> int:
    """A vision-language model's image placeholder id (config.json's image_token_id)."""
    c = _config(model_dir)
    found = c.get("image_token_id", c.get("image_token_index"))
    if not isinstance(found, int):
        raise ConfigError(f"'{model_dir}' is a vision-language model whose config.json names no image_token_id")
    return found


def collapse_image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """`ids` with each run of `image_token_id` cut to one: the prompt vLLM expands again."""
    out = []
    for t in ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a build for another torch (RuntimeError)
        return False
    return True


def vllm_plugin() -> None:
    """vLLM's general plugin (run in each of its processes): `images_without_torchvision` where the engine that
    started them has a vision-language model (IMAGES_ENV)."""
    if os.environ.get(IMAGES_ENV) == "1":
        images_without_torchvision()


def images_without_torchvision() -> None:
    """Where torchvision does not load: vLLM's Qwen2.5-VL runs on transformers' PIL image processor, without a
    video processor (see the module's docstring). Nothing is changed where torchvision loads."""
    os.environ[IMAGES_ENV] = "1"
    if getattr(images_without_torchvision, "done", False) or _torchvision_loads():
        return
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil

    # vLLM's qwen2_vl imports smart_resize (and names the image processor class) from the torchvision module
    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    stand_in = types.ModuleType(name)
    stand_in.smart_resize = pil.smart_resize
    stand_in.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[name] = stand_in

    import vllm.model_executor.models.qwen2_5_vl as qwen
    from vllm import ModelRegistry

    qwen.Qwen2_5_VLProcessor = _images_only(qwen.Qwen2_5_VLProcessor)
    # a registered class is inspected in this process (vLLM inspects its lazily named ones in a fresh
    # interpreter, which would import the torchvision module)
    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", qwen.Qwen2_5_VLForConditionalGeneration)
    images_without_torchvision.done = True


def _images_only(cls):
    """`cls` (a Qwen-VL processor class) whose from_pretrained builds it with no video processor."""

    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        @classmethod
        def from_pretrained(cls_, path, *args, trust_remote_code: bool = False, **kwargs):
            """The image processor and tokenizer of `path` (vLLM takes token prompts: no chat template)."""
            from transformers import AutoImageProcessor, AutoTokenizer

            images = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            made = cls_(image_processor=images, tokenizer=tok, video_processor=None)
            made.video_processor = _NoVideoProcessor()  # vLLM reads its kwargs' names
            return made

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = cls.__name__
    return ImagesOnly


class _NoVideoProcessor:
    """What vLLM reads of a video processor (the names of its keyword arguments); a video is refused."""

    def __init__(self):
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs

    def __call__(self, *args, **kwargs):
        raise ValueError("videos are not supported (vLLM's Qwen-VL processor here has no video processor: "
                         "torchvision does not load)")
