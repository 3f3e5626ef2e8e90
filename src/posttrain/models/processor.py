"""A vision-language model's processor (its tokenizer, image processor and chat template) and the model itself,
from a local directory.

    is_vision_dir("/models/Qwen2.5-VL-3B-Instruct")   # True: config.json has a vision_config
    processor = load_processor(path)                 # AutoProcessor, or the same built without a video processor
    processor.tokenizer                              # what the text-only code paths use

transformers builds a Qwen2-VL-style processor only with its video processor, and that needs torchvision: where
torchvision is missing (or cannot load, as a CUDA build beside a CPU torch), the processor is built here from
its image processor, tokenizer and chat template with no video processor, and a row with videos is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.errors import ModelError
from posttrain.files.cache import check_model_dir
from posttrain.text.lines import one_line

# the files a model release's processor is made of (kept beside checkpoints and exported models)
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.jinja", "chat_template.json")


def is_vision_dir(path: str | Path) -> bool:
    """Whether the model directory holds a vision-language model (its config has a vision tower's config)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """The processor of the vision-language model in `path` (its `.tokenizer` has a pad token: the EOS when
    none is set), or a ModelError naming what is missing."""
    from transformers import AutoProcessor

    p = check_model_dir(path)
    try:
        import PIL  # noqa: F401 - transformers' image processors decode and resize with it
    except ImportError:
        raise ModelError(f"'{p}' is a vision-language model, whose images need Pillow: "
                         "pip install 'posttrain[vision]'") from None
    if not (p / "preprocessor_config.json").exists():
        raise ModelError(f"the vision-language model in '{p}' has no preprocessor_config.json (its image "
                         "processor); copy the processor files of its release into the directory")
    try:
        processor = AutoProcessor.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        processor = _without_videos(p, trust_remote_code, e)
    if not hasattr(processor, "image_processor"):
        raise ModelError(f"the processor in '{p}' ({type(processor).__name__}) has no image processor; "
                         "point model.path at a vision-language model's directory")
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return processor


def _without_videos(p: Path, trust_remote_code: bool, first: Exception):
    """The processor class of `p` built from its image processor and tokenizer, with no video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    def fail(e):
        return ModelError(f"cannot load the processor from '{p}': {one_line(first)} (and without a video processor: "
                          f"{one_line(e)})")

    try:
        name = _processor_class(p)
        cls = getattr(transformers, name)
        images = AutoImageProcessor.from_pretrained(str(p), trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise fail(e) from first

    class NoVideos(cls):  # the class's own code, with "no video processor" allowed
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    NoVideos.__name__ = NoVideos.__qualname__ = cls.__name__
    template = _chat_template(p) or getattr(tok, "chat_template", None)
    kwargs = _settings(p)
    try:
        args = {"image_processor": images, "tokenizer": tok, "chat_template": template, **kwargs}
        if "video_processor" in cls.get_attributes():
            args["video_processor"] = None
        return NoVideos(**args)
    except Exception as e:  # noqa: BLE001
        raise fail(e) from first


def _processor_class(p: Path) -> str:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        try:
            found = json.loads((p / name).read_text(encoding="utf-8")).get("processor_class")
        except (OSError, ValueError):
            continue
        if found:
            return found
    raise ModelError(f"'{p}' names no processor class (processor_class in processor_config.json)")


def _settings(p: Path) -> dict:
    """processor_config.json's own settings (Idefics3's image_seq_len, ...)."""
    try:
        found = json.loads((p / "processor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if k != "processor_class" and not k.endswith("_processor")}


def _chat_template(p: Path) -> str | None:
    if (p / "chat_template.jinja").exists():
        return (p / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        return json.loads((p / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return None


def load_vision_model(path: str | Path, dtype, trust_remote_code: bool = False):
    """AutoModelForImageTextToText from safetensors weights only."""
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype,
                                                           trust_remote_code=trust_remote_code, use_safetensors=True)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load the vision-language model from '{path}': {one_line(e)}") from e


VALUE_HEAD = "posttrain_value_head"  # config.json's mark of a saved VLM critic (its lm_head is the value head)


def load_vision_value_model(path: str | Path, dtype, trust_remote_code: bool = False):
    """A vision-language model's body with a scalar head on every position (the critic's value model): its
    `lm_head` replaced by a Linear(hidden, 1) (fresh, as a token-classification head starts; or a saved
    critic's, whose config.json carries VALUE_HEAD). -> model whose `.logits` are [B, L, 1]."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot read the vision-language model's config in '{path}': {one_line(e)}") from e
    saved = bool(getattr(config, VALUE_HEAD, False))
    if saved:  # the body's weights and the head are in the critic's own safetensors
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = load_vision_model(path, dtype, trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = torch.nn.Linear(text.hidden_size, 1, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    torch.nn.init.zeros_(head.bias)
    model.lm_head = head
    for c in {id(model.config): model.config, id(text): text}.values():  # the head no longer shares the embedding
        c.tie_word_embeddings = False
    setattr(model.config, VALUE_HEAD, True)
    if saved:
        from safetensors.torch import load_file

        try:
            model.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"the saved critic in '{path}' does not load: {one_line(e)}; resume from another "
                             "checkpoint") from e
    return model
