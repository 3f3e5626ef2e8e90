"""Vision-language models through the passes: the HF engine's prefill with images, the log-prob pass, the
critic's forward, on tiny random models built offline (Qwen2.5-VL: 3-D positions; Idefics3: 1-D positions,
pixel_attention_mask). The reference is the model's own forward (transformers computes Qwen-VL's positions
itself when given none), one sequence at a time, unpadded."""

import copy
import inspect

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.driver.batch import RolloutBatch
from posttrain.models.processor import load_processor, load_vision_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.vision import ImagePrompt, end_at_placeholders, join_vision, placeholder_ids
from posttrain.tiny.vision import build_vlm_dir
from posttrain.training.logprobs import PassOptions, compute_log_probs

QUESTIONS = ["What is drawn?", "Count them.", "Add the two digits, please."]
SIZES = [(56, 56), (84, 56), (56, 112)]  # (width, height): 4, 6 and 8 image tokens (Qwen2.5-VL)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "idefics3"])
def vlm(request, tmp_path_factory):
    path = build_vlm_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    processor = load_processor(path)
    model = load_vision_model(path, torch.float64)
    return request.param, processor, model


def image(seed: int, size) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def prompts_of(family, processor, count=3, text_only=()):
    """ImagePrompts of QUESTIONS with one image each (none for indices in `text_only`)."""
    out = []
    for i in range(count):
        if i in text_only:
            msgs = [{"role": "user", "content": QUESTIONS[i]}]
            text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(ImagePrompt(ids, {}))
            continue
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[i]}]}]
        text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        img = image(i, SIZES[i])
        full = processor(text=[text], images=[[img]] if family == "idefics3" else [img], return_tensors="pt")
        vision = {k: v for k, v in full.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        out.append(ImagePrompt(full["input_ids"][0].tolist(), vision, [img]))
    return out


def own_log_probs(model, prompt, response) -> torch.Tensor:
    """The model's own forward over one unpadded sequence: log p of each response token."""
    ids = torch.tensor([list(prompt) + list(response)])
    extra = {}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters and prompt.vision:
        # as the processor marks image tokens: transformers then computes Qwen-VL's 3-D positions itself
        extra["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **join_vision([prompt.vision]),
                       **extra).logits
    log_p = torch.log_softmax(logits[0, len(prompt) - 1:-1].double(), -1)
    return log_p.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("shared_prefill", [True, False])
def test_rollout_log_probs_equal_the_models_own_forward(vlm, shared_prefill):
    family, processor, model = vlm
    prompts = prompts_of(family, processor, text_only=(1,))
    engine = HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=3,
                             progress=False, shared_prefill=shared_prefill, micro_batch_size=4)
    params = SamplingParams(max_new_tokens=6, n=2, temperature=1.0, logprobs=True)
    out = engine.generate(prompts, params)
    for row in range(len(prompts) * 2):
        mask = out.response_mask[row].bool()
        response = out.response_ids[row][mask].tolist()
        assert response, "every row sampled at least one token"
        want = own_log_probs(model, prompts[row // 2], response)
        torch.testing.assert_close(out.log_probs[row][mask].double(), want, atol=2e-6, rtol=0)  # kept in float32


def test_samples_do_not_depend_on_shared_prefill(vlm):
    family, processor, model = vlm
    prompts = prompts_of(family, processor)
    params = SamplingParams(max_new_tokens=5, n=3, temperature=1.0)
    outs = [HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=4,
                            progress=False, shared_prefill=flag).generate(prompts, params) for flag in (True, False)]
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)


def batch_of(prompts, out, n, model=None):
    if model is not None:  # as the driver does: a sampled image placeholder ends the response
        end_at_placeholders(out, placeholder_ids(model.config), 0)
    return RolloutBatch.from_rollout(out, n, ["s"] * len(prompts), ["g"] * len(prompts), [{}] * len(prompts),
                                     [""] * len(out.response_ids), vision=[p.vision for p in prompts])


@pytest.mark.parametrize("remove_padding,share_prompt,micro", [(True, True, 4), (False, False, 3), (True, False, 64),
                                                               (False, True, 2)])
def test_log_prob_pass_equals_the_models_own_forward(vlm, remove_padding, share_prompt, micro):
    family, processor, model = vlm
    prompts = prompts_of(family, processor, text_only=(2,))
    params = SamplingParams(max_new_tokens=5, n=2, temperature=1.0)
    out = HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=5,
                          progress=False).generate(prompts, params)
    batch = batch_of(prompts, out, 2, model)
    got, _ = compute_log_probs(model, batch, micro, options=PassOptions(remove_padding=remove_padding,
                                                                        share_prompt=share_prompt))
    for row in range(len(batch)):
        mask = out.response_mask[row].bool()
        want = own_log_probs(model, prompts[row // 2], out.response_ids[row][mask].tolist())
        torch.testing.assert_close(got[row][mask].double(), want, atol=2e-6, rtol=0)  # kept in float32


def test_same_tokens_other_images_are_not_one_prompt(vlm):
    """Two prompts of equal tokens (the same question, images of one size) but different images: the shared
    prompt path must not run one prompt's image for the other's samples."""
    family, processor, model = vlm
    a, b = prompts_of(family, processor, count=1) * 2
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    other = image(99, SIZES[0])
    full = processor(text=[text], images=[[other]] if family == "idefics3" else [other], return_tensors="pt")
    assert full["input_ids"][0].tolist() == list(a)
    b = ImagePrompt(list(a), {k: v for k, v in full.items() if k not in ("input_ids", "attention_mask",
                                                                           "mm_token_type_ids")})
    prompts = [a, b]
    params = SamplingParams(max_new_tokens=4, n=2, temperature=1.0)
    out = HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=6,
                          progress=False).generate(prompts, params)
    batch = batch_of(prompts, out, 2, model)
    got, _ = compute_log_probs(model, batch, 8, options=PassOptions(share_prompt=True))
    for row in range(4):
        mask = out.response_mask[row].bool()
        want = own_log_probs(model, prompts[row // 2], out.response_ids[row][mask].tolist())
        torch.testing.assert_close(got[row][mask].double(), want, atol=2e-6, rtol=0)  # kept in float32


def test_training_gradient_reaches_the_vision_tower(vlm):
    family, processor, model = vlm
    model = copy.deepcopy(model)
    prompts = prompts_of(family, processor, count=2)
    out = HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=7,
                          progress=False).generate(prompts, SamplingParams(max_new_tokens=4, n=2))
    batch = batch_of(prompts, out, 2, model)
    from posttrain.training.microbatch import micro_batches
    from posttrain.training.logprobs import log_probs_and_entropy

    model.train()
    (_, mb), = micro_batches(batch, 8, True)
    log_prob, _ = log_probs_and_entropy(model, mb, "cpu", 1.0, PassOptions(), with_entropy=False)
    (log_prob * mb.response_mask).sum().backward()
    tower = [p for n, p in model.named_parameters() if "visual" in n or "vision" in n]
    assert tower and all(p.grad is not None for p in tower[:3])
    assert any(p.grad.abs().sum() > 0 for p in tower if p.grad is not None)


def test_a_sampled_image_placeholder_ends_the_response():
    """Rows 0 and 2 sample the placeholder (id 9): each ends before it, as truncated; row 1 is untouched."""
    from posttrain.rollout.base import RolloutOutput

    ids = torch.tensor([[4, 9, 5, 1], [4, 5, 6, 1], [9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = RolloutOutput(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long), ids.clone(),
                        mask.clone(), log_probs=torch.full((3, 4), -1.0), truncated=torch.tensor([False] * 3))
    assert end_at_placeholders(out, [9], pad_token_id=0) == 2
    assert out.response_ids.tolist() == [[4, 0, 0, 0], [4, 5, 6, 1], [0, 0, 0, 0]]
    assert out.response_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert out.log_probs.tolist() == [[-1, 0, 0, 0], [-1, -1, -1, -1], [0, 0, 0, 0]]
    assert out.truncated.tolist() == [True, False, True]


def test_placeholder_ids_from_the_processor_and_the_config(vlm):
    family, processor, model = vlm
    image = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>" if family == "qwen2_5_vl" else "<image>")
    assert image in placeholder_ids(processor)
    assert placeholder_ids(model.config) == placeholder_ids(processor)


def test_freeze_vision_tower_and_lora_on_the_language_model_only(vlm):
    from posttrain.models.loader import freeze_vision_tower
    from posttrain.models.lora import LoraSettings, add_adapters

    family, processor, model = vlm
    frozen = copy.deepcopy(model)
    count = freeze_vision_tower(frozen)
    tower = [p for n, p in frozen.named_parameters() if "visual" in n or "vision_model" in n]
    assert count == sum(p.numel() for p in tower) > 0
    assert not any(p.requires_grad for p in tower)
    adapted = add_adapters(copy.deepcopy(model), LoraSettings(rank=4))
    names = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not any("visual" in n or "vision_model" in n or "connector" in n for n in names)
    assert any("language_model" in n or "text_model" in n for n in names)


def test_what_is_not_supported_yet_is_refused_in_one_line(vlm, tmp_path):
    """vLLM rollouts with images on a family other than Qwen2.5-VL, multi-turn rollouts with images: one line
    each."""
    from posttrain.driver.sampling import sample
    from posttrain.errors import DataError
    from posttrain.rollout.vllm_vision import vllm_vision_family

    family, processor, model = vlm
    model.config.save_pretrained(tmp_path / "m")
    refused = vllm_vision_family(tmp_path / "m")  # vLLM takes Qwen2.5-VL's images (tests/test_vllm_vision.py)
    if family == "qwen2_5_vl":
        assert refused is None
    else:
        assert "Qwen2.5-VL models only" in refused and "rollout.name=hf" in refused and "\n" not in refused

    class Item:
        prompt_ids, images, index, data_source, ground_truth, extra_info, messages = [1, 2], [image(0, (56, 56))], 0, \
            "s", "g", {}, []

    with pytest.raises(DataError, match="multi-turn rollouts .* do not take images yet"):
        sample(None, processor.tokenizer, [Item()], SamplingParams(max_new_tokens=2), tools=object(),
               processor=processor)


def test_the_critic_of_a_vlm_values_every_position_and_saves_and_loads(vlm, tmp_path):
    """A value head on the VLM's body: the values of the critic pass equal those of the model's own forward one
    sequence at a time; a checkpoint's critic (its config marked, its weights as saved) loads back the same."""
    import json

    from safetensors.torch import save_file

    from posttrain.checkpoint.state import critic_snapshot
    from posttrain.models.loader import load_value_model
    from posttrain.training.critic import compute_values

    family, processor, model = vlm
    src = build_vlm_dir(tmp_path / "src", family, seed=1)
    critic = load_value_model(src, dtype="float32").double()
    prompts = prompts_of(family, processor, text_only=(1,))
    out = HFRolloutEngine(model, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=8,
                          progress=False).generate(prompts, SamplingParams(max_new_tokens=4, n=2))
    batch = batch_of(prompts, out, 2, model)
    values = compute_values(critic, batch, 3)
    for row in range(len(batch)):
        p, mask = prompts[row // 2], out.response_mask[row].bool()
        ids = torch.tensor([list(p) + out.response_ids[row][mask].tolist()])
        extra = {}
        if "mm_token_type_ids" in inspect.signature(critic.forward).parameters and p.vision:
            extra["mm_token_type_ids"] = (ids == critic.config.image_token_id).int()
        with torch.no_grad():
            own = critic(input_ids=ids, attention_mask=torch.ones_like(ids), **join_vision([p.vision]), **extra)
        assert own.logits.shape[-1] == 1
        want = own.logits[0, len(p) - 1:-1, 0]
        torch.testing.assert_close(values[row][mask].double(), want, atol=2e-6, rtol=0)
    saved = tmp_path / "critic"
    saved.mkdir()
    snap = critic_snapshot(critic.float(), torch.optim.SGD(critic.parameters(), lr=0.1),
                           torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(critic.parameters(), lr=0.1),
                                                             lambda s: 1.0))
    (saved / "config.json").write_text(snap["config"])
    save_file(snap["model"], str(saved / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (saved / name).write_bytes((src / name).read_bytes())
    assert json.loads(snap["config"])["posttrain_value_head"] is True
    again = load_value_model(saved, dtype="float32")
    for (k, a), (_, b) in zip(critic.float().state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_ulysses_refuses_images():
    from types import SimpleNamespace

    from posttrain.training.logprobs import refuse_images

    refuse_images(SimpleNamespace(vision=[{}, {}]))  # text rows of a VLM: fine
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=1"):
        refuse_images(SimpleNamespace(vision=[{}, {"pixel_values": torch.zeros(1)}]))


SHARDED_VLM = """
import copy, sys, tempfile, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_vision_model import *
from posttrain.training.parallelize import parallelize, vision_blocks, decoder_layers
from posttrain.training.microbatch import micro_batches
from posttrain.training.logprobs import log_probs_and_entropy
from posttrain.rollout.weights import named_full_weights
dist.init_process_group("gloo", init_method=f"file://{{tempfile.mkdtemp()}}/rdzv", rank=0, world_size=1)
processor = load_processor({path!r})
base = load_vision_model({path!r}, torch.float32)
prompts = prompts_of({family!r}, processor, count=2)
out = HFRolloutEngine(base, [processor.tokenizer.eos_token_id], processor.tokenizer.pad_token_id, seed=7,
                      progress=False).generate(prompts, SamplingParams(max_new_tokens=4, n=2))
batch = batch_of(prompts, out, 2, base)
after = []
for shard in (False, True):
    m = copy.deepcopy(base)
    if shard:
        m = parallelize(m)
        assert vision_blocks(m) and all(hasattr(b, "_get_fsdp_state") for b in vision_blocks(m))
        assert all(hasattr(layer, "_get_fsdp_state") for layer in decoder_layers(m))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m.train()
    (_, mb), = micro_batches(batch, 8, True)
    log_prob, _ = log_probs_and_entropy(m, mb, "cpu", 1.0, PassOptions(), with_entropy=False)
    (log_prob * mb.response_mask).sum().backward()
    opt.step()
    after.append(dict(named_full_weights(m)))
worst = max((after[0][k] - after[1][k]).abs().max().item() for k in after[0])
moved = max((after[0][k] - v).abs().max().item() for k, v in base.state_dict().items() if k in after[0])
print(worst, moved)
"""


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_fsdp2_shards_the_language_model_and_the_vision_tower_and_changes_no_update(family, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = build_vlm_dir(tmp_path / family, family, seed=1)
    script = SHARDED_VLM.format(tests=str(Path(__file__).parent), path=str(path), family=family)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    worst, moved = map(float, done.stdout.split()[-2:])
    assert moved > 1e-3 and worst < 1e-6


def test_vllm_gets_each_run_of_image_tokens_as_one_placeholder(tmp_path):
    """vLLM expands an image's placeholder itself (tests/test_vllm_vision.py runs it): each run of image tokens of
    the processor's full call goes back to the one placeholder of the chat template's text, text tokens untouched;
    vLLM's prompt ids that differ from posttrain's stop the rollout."""
    from types import SimpleNamespace

    from posttrain.rollout.vllm_output import check_expanded_prompts
    from posttrain.rollout.vllm_vision import collapse_image_runs

    path = build_vlm_dir(tmp_path / "qwen", "qwen2_5_vl", seed=1)  # vLLM takes Qwen2.5-VL's images
    processor, model = load_processor(path), load_vision_model(path, torch.float32)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "A"}, {"type": "image"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    full = processor(text=[text], images=[image(0, SIZES[0]), image(1, SIZES[2])], return_tensors="pt")
    ids = full["input_ids"][0].tolist()
    pad = model.config.image_token_id
    assert ids.count(pad) == 4 + 8 and unexpanded.count(pad) == 2
    assert collapse_image_runs(ids, pad) == unexpanded
    prompt = ImagePrompt(ids, {}, [image(0, SIZES[0]), image(1, SIZES[2])])
    check_expanded_prompts([SimpleNamespace(prompt_token_ids=ids)], [prompt])
    with pytest.raises(RuntimeError, match="other tokens than the HF processor"):
        check_expanded_prompts([SimpleNamespace(prompt_token_ids=ids + [pad])], [prompt])
