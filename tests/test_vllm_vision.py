"""vLLM rollouts with images (its CPU build, .venv-vllm), on a tiny random Qwen2.5-VL: one engine for the file.

The tiny model's heads are 64 wide (hidden 256, 4 heads): vLLM's CPU attention has no kernel for the default
tiny VLM's 16 ("Unsupported CPU attention configuration: head_dim=16"). The worker starts vLLM from random
weights (rollout.load_format=dummy_dtensor) and pushes the policy's in under transformers' names
(`model.language_model.*`, `model.visual.*`), so every comparison with the trainer also shows that push arrived.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.driver.batch import RolloutBatch
from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.vllm

LOGP_ATOL = 1e-4  # |log p_vllm - log p_trainer| per sampled token, float32 (as tests/test_vllm_engine.py)
GREEDY = SamplingParams(max_new_tokens=6, n=1, do_sample=False, temperature=0.0)
SIZES = [(84, 56), (56, 112)]  # (width, height): 6 and 8 image tokens after the processor's resize


def image(seed: int, size):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from posttrain.config import load_config
    from posttrain.driver.settings import worker_spec
    from posttrain.models.processor import load_processor
    from posttrain.tiny.vision import build_vlm_dir
    from posttrain.worker.verbs import Worker

    path = build_vlm_dir(tmp_path_factory.mktemp("qwen_vl"), "qwen2_5_vl", seed=1, hidden=256)
    cfg = load_config(None, [f"model.path={path}", "rollout.name=vllm", "rollout.load_format=dummy_dtensor",
                             "data.max_prompt_length=96", "data.max_response_length=16", "data.train_batch_size=3",
                             "rollout.n=2", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=6",
                             "actor.lr=1e-2", "actor.weight_decay=0"])
    w = Worker(worker_spec(cfg, str(path), None, "cpu", total_steps=4))
    w.setup()
    yield path, load_processor(path), w
    w.engine.shutdown()


def prompts_of(processor):
    """Two prompts with an image each (two sizes) and one text-only, as driver/sampling.vision_prompts makes
    them: the processor's full call's ids (each image's placeholder expanded), its tensors and the images."""
    from posttrain.data.images import vision_inputs
    from posttrain.rollout.vision import ImagePrompt

    out = []
    for i, size in enumerate([*SIZES, None]):
        content = [{"type": "text", "text": f"Question {i}: what is drawn?"}]
        if size is not None:
            content.insert(0, {"type": "image"})
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        images = [image(i, size)] if size is not None else []
        ids = (processor(text=[text], images=images, return_tensors="pt") if images else
               processor(text=[text], return_tensors="pt"))["input_ids"][0].tolist()
        out.append(ImagePrompt(ids, vision_inputs(processor, images, f"row {i}") if images else {}, images))
    return out


def batch_of(prompts, out, n: int, processor) -> RolloutBatch:
    """As the driver makes it (driver/sampling.py): a response that sampled an image placeholder (a random
    model may) ends before it."""
    from posttrain.rollout.vision import end_at_placeholders, placeholder_ids

    end_at_placeholders(out, placeholder_ids(processor), processor.tokenizer.pad_token_id)
    rows = len(prompts)
    return RolloutBatch.from_rollout(out, n, ["s"] * rows, ["g"] * rows, [{}] * rows, [""] * rows * n,
                                     vision=[p.vision for p in prompts])


def hf_greedy(worker, prompts):
    """posttrain's own engine over the worker's policy: the reference for vLLM's tokens."""
    from posttrain.models.loader import eos_token_ids
    from posttrain.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(worker.policy, eos_token_ids(worker.tokenizer, worker.policy),
                             worker.tokenizer.pad_token_id, progress=False)
    return engine.generate(prompts, GREEDY)


def sampled(worker, processor, prompts, n: int = 2) -> RolloutBatch:
    out = worker.generate(prompts, SamplingParams(max_new_tokens=8, n=n, temperature=1.0, logprobs=True))
    return batch_of(prompts, out, n, processor)


def logp_diff(worker, batch) -> float:
    train = worker.compute_log_probs(batch)
    return (train - batch.rollout_log_probs).abs()[batch.response_mask.bool()].max().item()


def test_prompts_with_images_sample_as_the_trainer_scores_them(vlm):
    """vLLM's prompt ids are posttrain's expanded ones (the engine checks it for every prompt with images), its
    greedy tokens are the hf engine's (which sees the processor's tensors), its sampled log-probs are the
    trainer's pass over the same rows, and not that pass's with another image in the prompt."""
    from posttrain.rollout.vision import ImagePrompt

    _, processor, worker = vlm
    prompts = prompts_of(processor)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [p.count(pad) for p in prompts] == [6, 8, 0]
    requests = worker.engine.llm.generate([worker.engine.tokens_prompt(p) for p in prompts[:2]], use_tqdm=False)
    assert [list(r.prompt_token_ids) for r in requests] == [list(p) for p in prompts[:2]]

    greedy = worker.generate(prompts, GREEDY)
    assert greedy.response_ids.tolist() == hf_greedy(worker, prompts).response_ids.tolist()

    out = worker.generate(prompts, SamplingParams(max_new_tokens=8, n=2, temperature=1.0, logprobs=True))
    batch = batch_of(prompts, out, 2, processor)
    assert len(batch) == 6
    worst = logp_diff(worker, batch)
    print(f"vLLM vs trainer log-prob max |diff|: {worst:.2e}")
    assert worst < LOGP_ATOL, worst
    # the trainer's pass with another image in prompt 0 (the same tokens): vLLM's log-probs are not that pass's
    from posttrain.data.images import vision_inputs

    other = image(99, SIZES[0])
    swapped = batch_of([ImagePrompt(list(prompts[0]), vision_inputs(processor, [other], "other"), [other]),
                        *prompts[1:]], out, 2, processor)
    mask = batch.response_mask[:2].bool()
    assert (worker.compute_log_probs(swapped)[:2] - batch.rollout_log_probs[:2]).abs()[mask].mean() > 100 * LOGP_ATOL


def test_after_an_update_vllm_samples_from_the_new_weights(vlm):
    """One policy update on vLLM's samples with images, pushed to the engine: its greedy tokens are the hf
    engine's over the updated policy, its log-probs the trainer's, and the shipped model scores them otherwise."""
    from posttrain.models.processor import load_vision_model
    from posttrain.training.logprobs import compute_log_probs

    path, processor, worker = vlm
    prompts = prompts_of(processor)
    batch = sampled(worker, processor, prompts)
    torch.manual_seed(0)
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    batch.old_log_probs = worker.compute_log_probs(batch)
    worker.train_step(batch)
    worker.sync_weights()

    assert worker.generate(prompts, GREEDY).response_ids.tolist() == hf_greedy(worker, prompts).response_ids.tolist()
    after = sampled(worker, processor, prompts)
    worst = logp_diff(worker, after)
    print(f"after the update, vLLM vs trainer log-prob max |diff|: {worst:.2e}")
    assert worst < LOGP_ATOL, worst
    shipped, _ = compute_log_probs(load_vision_model(path, torch.float32), after, 8)
    mask = after.response_mask.bool()
    assert (shipped - after.rollout_log_probs).abs()[mask].mean().item() > 100 * LOGP_ATOL
