"""Prompts with images (data/images.py, PromptDataset.build with a processor): verl's and TRL's row layouts, the
<image> placeholders, ids and tensors equal to the processor's full call, the rows refused or skipped, on the tiny
Qwen2.5-VL and Idefics3 models (posttrain.tiny.vision)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from posttrain.data.dataset import PromptDataset
from posttrain.data.images import (
    decode_image,
    encode_vision_prompt,
    refuse_videos,
    row_images,
    vision_inputs,
    with_image_parts,
)
from posttrain.data.schema import write_rows
from posttrain.errors import DataError

FAMILIES = ("qwen2_5_vl", "idefics3")


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    from posttrain.models.processor import load_processor
    from posttrain.tiny.vision import build_vlm_dir

    out = tmp_path_factory.mktemp("vlm")
    return {f: load_processor(build_vlm_dir(out / f, family=f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def text_tokenizer():
    from transformers import AutoTokenizer

    from posttrain.tiny.arith import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model(progress=False)))


def png(width=56, height=56, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


SQUARE, WIDE = png(), png(84, 56, (20, 160, 40))


def row(content, truth="1", **columns):
    return {"data_source": "geo", "prompt": [{"role": "user", "content": content}], "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {}, **columns}


def full_call(processor, parts, images):
    """The processor's own full call on hand-made content parts: what the model sees."""
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[text], images=[pil] if pil else None, return_tensors="pt")


def test_row_images_reads_verls_and_trls_columns():
    item = {"bytes": SQUARE, "path": None}
    assert row_images({"images": [item, "a.png"]}, "images") == [item, "a.png"]
    assert row_images({"image": SQUARE}, "images") == [SQUARE]  # TRL's one image
    assert row_images({"images": None, "image": item}, "images") == [item]
    assert row_images({"images": [item], "image": SQUARE}, "images") == [item]  # the images column wins
    assert row_images({"image": SQUARE}, "pics") == []  # TRL's column only under the default key
    assert row_images({"pics": item}, "pics") == [item]
    assert row_images({"prompt": "x"}, "images") == row_images({"images": []}, "images") == []
    import numpy as np  # rows built with pandas hold object arrays

    assert row_images({"images": np.array([item], dtype=object)}, "images") == [item]
    assert row_images({"images": np.array([], dtype=object)}, "images") == []


def test_decode_image_takes_bytes_dicts_paths_and_pil(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(WIDE)
    monkeypatch.chdir(tmp_path)  # relative paths: the working directory
    rgba = Image.new("RGBA", (30, 20))
    for value, size in [(SQUARE, (56, 56)), ({"bytes": SQUARE, "path": "ignored.png"}, (56, 56)),
                        ({"bytes": None, "path": str(tmp_path / "a.png")}, (84, 56)), ("a.png", (84, 56)),
                        (f"file://{tmp_path / 'a.png'}", (84, 56)), (rgba, (30, 20))]:
        image = decode_image(value, "train row 0 image 0")
        assert (image.mode, image.size) == ("RGB", size)


@pytest.mark.parametrize("value, message", [
    (b"not a png", r"^train row 7 image 2 does not decode as an image \(.*\); store PNG or JPEG bytes"),
    ({"bytes": SQUARE[:60], "path": None}, "^train row 7 image 2 does not decode as an image"),
    ("missing.png", (r"^train row 7 image 2: no image file 'missing.png' \(relative paths are read from the "
                     r"working directory, .*\); give an absolute path or store the image's bytes$")),
    ({"bytes": None, "path": None}, "neither 'bytes' nor 'path'"),
    ("https://example.com/a.png", "is a URL .*posttrain does not download images"),
    (3, "^train row 7 image 2 is int, not image bytes"),
])
def test_an_image_that_does_not_decode_is_one_line_naming_it(value, message):
    with pytest.raises(DataError, match=message) as caught:
        decode_image(value, "train row 7 image 2")
    assert "\n" not in str(caught.value)


def test_image_parts_follow_the_placeholders_in_order_or_go_first():
    two = with_image_parts([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Compare <image> and <image>."}], 2, "train row 0")
    assert two == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                   {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                                {"type": "text", "text": " and "}, {"type": "image"},
                                                {"type": "text", "text": "."}]}]
    first = with_image_parts([{"role": "system", "content": "S"}, {"role": "user", "content": "What is it?"},
                              {"role": "user", "content": "Again"}], 2, "train row 0")  # TRL's layout
    assert first[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert first[2]["content"] == [{"type": "text", "text": "Again"}]
    assert with_image_parts("<image>Hi", 1, "r")[0] == {"role": "user", "content": [{"type": "image"},
                                                                                    {"type": "text", "text": "Hi"}]}
    kept = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    assert with_image_parts(kept, 1, "r") == kept
    assert with_image_parts([{"role": "user", "content": "text only"}], 0, "r")[0]["content"] == [
        {"type": "text", "text": "text only"}]
    with pytest.raises(DataError, match=r"^train row 4 has 2 <image> placeholder\(s\) but 1 image\(s\); "
                                        "put one <image> in the text per image, in order"):
        with_image_parts([{"role": "user", "content": "<image> vs <image>"}], 1, "train row 4")
    with pytest.raises(DataError, match="has 1 <image> placeholder"):
        with_image_parts([{"role": "user", "content": "<image>?"}], 0, "train row 4")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_and_tensors_are_the_processors_full_call(processors, family):
    processor = processors[family]
    rows = [row("Compare <image> with <image>.", images=[{"bytes": SQUARE, "path": None}, {"bytes": WIDE}]),
            row("What colour?", image={"bytes": SQUARE, "path": None})]  # TRL's column, no placeholder
    data = PromptDataset.build(rows, processor.tokenizer, 512, processor=processor)
    parts = [[{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                           {"type": "text", "text": " with "}, {"type": "image"},
                                           {"type": "text", "text": "."}]}],
             [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]]
    for item, p, images in zip(data, parts, [[SQUARE, WIDE], [SQUARE]]):
        full = full_call(processor, p, images)
        assert item.prompt_ids == full["input_ids"][0].tolist()
        assert item.prompt_ids == encode_vision_prompt(processor, item.messages, item.images, None)
        tensors = vision_inputs(processor, item.images, f"train row {item.index}")
        expected = {k: v for k, v in full.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert data[0].images == [{"bytes": SQUARE, "path": None}, {"bytes": WIDE}]  # as stored, undecoded
    assert data[1].images == [{"bytes": SQUARE, "path": None}]
    tensors = vision_inputs(processor, data[0].images, "train row 0")
    if family == "qwen2_5_vl":  # 14x14 patches, 2x2 of them a token: 56x56 -> 4 tokens, 84x56 -> 6
        assert tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
        assert tuple(tensors["pixel_values"].shape) == (40, 1176)
        assert data[0].prompt_ids.count(processor.image_token_id) == 10
    else:  # each image resized to 32x32: 4 tokens
        assert tuple(tensors["pixel_values"].shape) == (1, 2, 3, 32, 32)
        assert tuple(tensors["pixel_attention_mask"].shape) == (1, 2, 32, 32)
        assert data[0].prompt_ids.count(processor.image_token_id) == 8
    assert vision_inputs(processor, [], "train row 0") == {}


def test_template_arguments_reach_the_processors_template_and_rows_stay_as_stored(processors):
    processor = processors["qwen2_5_vl"]
    messages = [{"role": "user", "content": "<image>Hi"}]
    plain = encode_vision_prompt(processor, messages, [SQUARE], None)
    assert encode_vision_prompt(processor, messages, [SQUARE], {"enable_thinking": False}) == plain  # not read
    own = processor.chat_template
    processor.chat_template = own + "{%- if flag %}F{%- endif %}"
    try:
        assert encode_vision_prompt(processor, messages, [SQUARE], {"flag": True}) == plain + [ord("F")]
    finally:
        processor.chat_template = own
    assert messages == [{"role": "user", "content": "<image>Hi"}]  # the parts are a copy


def test_verl_rows_with_a_path_raw_bytes_and_a_text_only_row(processors, tmp_path, monkeypatch):
    processor = processors["qwen2_5_vl"]
    (tmp_path / "wide.png").write_bytes(WIDE)
    monkeypatch.chdir(tmp_path)
    rows = [row("<image>Which?", images=["wide.png"]), row("<image>Which?", images=[WIDE]),
            row("2+2?"), row("2+2?", images=[])]
    data = PromptDataset.build(rows, processor.tokenizer, 512, processor=processor)
    assert len(data) == 4 and data.num_invalid == 0
    assert data[0].prompt_ids == data[1].prompt_ids  # the same image, from a path and from bytes
    assert data[0].images == ["wide.png"] and data[2].images is None and data[3].images is None
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    assert data[2].prompt_ids == processor(text=[text], return_tensors="pt")["input_ids"][0].tolist()
    assert data[2].prompt_ids == processor.tokenizer.encode(text, add_special_tokens=False)


def test_rows_whose_images_fail_are_skipped_and_counted(processors, capsys):
    processor = processors["idefics3"]
    rows = [row("<image>ok", images=[SQUARE]), row("<image> and <image>", images=[SQUARE]),
            row("<image>x", images=[b"not an image"]), row("fine", image=SQUARE)]
    data = PromptDataset.build(rows, processor.tokenizer, 512, processor=processor)
    assert [item.index for item in data] == [0, 3] and data.num_invalid == 2
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("posttrain: warning: skipped 2 of 4 train rows (row 1: the prompt has 2 <image> "
                              "placeholder(s) but 1 image(s);")
    assert "row 2: image 0 does not decode as an image" in warning and warning.endswith("; fix or drop them")
    assert len(warning.splitlines()) == 1
    with pytest.raises(DataError, match=r"^train dataset has no usable row: skipped 2 of 2 rows \(row 0: the prompt "
                                        r"has 1 <image> placeholder\(s\) but 0 image.*row 1: image 0 does not decode"):
        PromptDataset.build([row("<image>", images=[]), row("y", images=[b"?"])], processor.tokenizer, 512,
                            processor=processor)


def test_videos_are_refused(processors, text_tokenizer):
    for tok, processor in [(text_tokenizer, None), (processors["qwen2_5_vl"].tokenizer, processors["qwen2_5_vl"])]:
        with pytest.raises(DataError, match=r"^validation row 1 has videos in its 'clips' column \(data.video_key\): "
                                            "videos are not supported yet; drop the column or the rows"):
            PromptDataset.build([row("a"), row("b", clips=[{"path": "v.mp4"}])], tok, 512, processor=processor,
                                video_key="clips", name="validation")
    refuse_videos(row("a", videos=[]), "videos", "train row 0")  # an empty column is no video


def test_an_image_row_on_a_text_only_model_is_refused(text_tokenizer):
    data = PromptDataset.build([row("2+2?", images=None), row("3+3?", images=[])], text_tokenizer, 512)
    assert len(data) == 2 and data[0].images is None  # text datasets as before
    with pytest.raises(DataError) as caught:
        PromptDataset.build([row("a"), row("<image>b", pics=[{"bytes": SQUARE}])], text_tokenizer, 512,
                            image_key="pics")
    assert str(caught.value) == (
        "train row 1 has images in its 'pics' column (data.image_key), but the model is text-only: point model.path "
        "at a vision-language model (e.g. Qwen2.5-VL) or drop the column")
    with pytest.raises(DataError, match="train row 0 has images in its 'images' column"):  # TRL's `image` too
        PromptDataset.build([row("b", image=SQUARE)], text_tokenizer, 512)


def test_image_tokens_count_against_the_prompt_length(processors, capsys):
    processor = processors["qwen2_5_vl"]
    small, large = row("<image>Which?", images=[SQUARE]), row("<image>Which?", images=[WIDE])
    lengths = [len(PromptDataset.build([r], processor.tokenizer, 512, processor=processor)[0].prompt_ids)
               for r in (small, large)]
    assert lengths[1] - lengths[0] == 2  # 6 image tokens against 4
    data = PromptDataset.build([small, large], processor.tokenizer, lengths[0], processor=processor)
    assert len(data) == 1 and data.num_dropped == 1 and data[0].images == [SQUARE]
    assert "dropped 1 of 2 train prompts longer than max_prompt_length=" in capsys.readouterr().err
    for truncation in ("left", "right", "error"):
        with pytest.raises(DataError) as caught:
            PromptDataset.build([small, large], processor.tokenizer, lengths[0], filter_overlong=False,
                                truncation=truncation, processor=processor)
        assert str(caught.value) == (
            f"train row 1 has {lengths[1]} prompt tokens (6 of them its images' tokens, which count), over "
            f"data.max_prompt_length={lengths[0]}; a prompt with images is not cut (data.truncation={truncation}): "
            "raise data.max_prompt_length, set data.filter_overlong_prompts=True, or use smaller images")
    text_only = PromptDataset.build([row("What is 2+2? " * 10)], processor.tokenizer, 20, filter_overlong=False,
                                    truncation="left", processor=processor)
    assert len(text_only[0].prompt_ids) == 20  # a prompt without images is still cut


def test_load_data_reads_images_from_parquet_with_the_processor(processors, text_tokenizer, tmp_path):
    from posttrain.config.load import load_config
    from posttrain.driver.build_data import load_data

    path = write_rows([row("<image>Which?", images=[{"bytes": SQUARE, "path": None}]),
                       row("Name it.", images=[{"bytes": WIDE, "path": None}])], tmp_path / "train.parquet")
    cfg = load_config(None, ["model.path=/m"])
    processor = processors["qwen2_5_vl"]
    data = load_data([str(path)], processor.tokenizer, cfg, "train", processor=processor)
    assert [len(item.images) for item in data] == [1, 1]
    assert data[1].prompt_ids == full_call(processor, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Name it."}]}], [WIDE])["input_ids"][0].tolist()
    with pytest.raises(DataError, match="but the model is text-only"):
        load_data([str(path)], text_tokenizer, cfg, "train")


def test_trls_conversational_rows_with_content_parts_and_an_image_column(processors, tmp_path):
    """TRL's layout: the prompt's content already parts ({"type": "image"} where the image goes), the image in an
    `image` column; read back from parquet (where every part gains the other parts' keys as nulls)."""
    from posttrain.config.load import load_config
    from posttrain.driver.build_data import load_data

    parts = [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": "what colour?"}]
    path = write_rows([row(parts, image={"bytes": SQUARE, "path": None})], tmp_path / "trl.parquet")
    cfg = load_config(None, ["model.path=/m"])
    processor = processors["qwen2_5_vl"]
    data = load_data([str(path)], processor.tokenizer, cfg, "train", processor=processor)
    assert len(data) == 1 and len(data[0].images) == 1
    assert data[0].prompt_ids == full_call(processor, [{"role": "user", "content": parts}],
                                           [SQUARE])["input_ids"][0].tolist()
