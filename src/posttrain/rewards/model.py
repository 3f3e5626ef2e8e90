"""A reward model: a Hugging Face sequence-classification model that scores
each (prompt, response) chat, as verl's `reward_model.enable` does.

The chat (the row's prompt messages, then the response as the assistant's
turn) goes through the reward model's own chat template and tokenizer, and
the score is the last label's logit at the last token (one label: the
reward). Used alone it is the reward; with a custom reward function
(`reward.custom_fn`) that function decides, finding the model's score in
`extra_info["rm_score"]` (to mix it with a rule check, say).

    rm = RewardModel("models/rm", device="cpu", micro_batch_size=16)
    rm.score([[{"role": "user", "content": "2+2?"}]], ["4"])  -> [1.73]
"""

from __future__ import annotations

import torch

from posttrain.rewards.scoring import ScoreResult


class RewardModel:
    def __init__(self, path: str, device: str = "cpu", micro_batch_size: int = 64, max_length: int | None = None,
                 trust_remote_code: bool = False, dtype: torch.dtype = torch.float32, remove_padding: bool = True,
                 param_offload: bool = False):
        """remove_padding: chats of alike length share a pass (less padding); param_offload: the weights
        wait in CPU memory between scoring calls and visit `device` for each."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from posttrain.errors import ModelError
        from posttrain.files.cache import check_model_dir

        check_model_dir(path, fix="point reward_model.model.path (reward.model.path) at a Hugging Face "
                              "sequence-classification model directory")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code).eval().requires_grad_(False)
        except (OSError, ValueError) as e:
            raise ModelError(f"reward model '{path}' does not load as a sequence-classification model "
                             f"({str(e).splitlines()[0][:200]}); reward.model.path needs one (a scalar head)") from e
        # the model finds each row's last real token by the pad id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.micro_batch_size, self.max_length = device, micro_batch_size, max_length
        self.remove_padding, self.param_offload = remove_padding, param_offload
        self.model.to("cpu" if param_offload else device)

    def chat_text(self, prompt, response: str) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                  tokenize=False)

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str]) -> list[float]:
        """One score per (prompt messages, response text), in micro-batches."""
        texts = [self.chat_text(p, r) for p, r in zip(prompts, responses, strict=True)]
        order = list(range(len(texts)))
        if self.remove_padding:
            order.sort(key=lambda i: len(texts[i]))
        out = [0.0] * len(texts)
        if self.param_offload:
            self.model.to(self.device)
        try:
            for start in range(0, len(texts), self.micro_batch_size):
                rows = order[start:start + self.micro_batch_size]
                enc = self.tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True,
                                     add_special_tokens=False, truncation=self.max_length is not None,
                                     max_length=self.max_length)
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # [b, labels]
                for i, v in zip(rows, logits[:, -1].float().cpu().tolist()):
                    out[i] = v
        finally:
            if self.param_offload:
                self.model.to("cpu")
        return out


class ModelRewards:
    """`score_batch` as a RewardPool's, with a reward model: its score is the
    reward, or with `pool` (a custom function) that function's input as
    extra_info["rm_score"]. An empty response scores 0, unjudged, as it does
    with rule rewards."""

    def __init__(self, model: RewardModel, pool=None):
        self.model, self.pool = model, pool

    def load(self) -> None:
        if self.pool is not None:
            self.pool.load()

    def score_batch(self, data_sources, solution_strs, ground_truths, extra_infos, prompts=None) -> ScoreResult:
        if prompts is None:
            raise ValueError("a reward model needs each response's prompt")
        todo = [i for i, s in enumerate(solution_strs) if s != ""]
        rm = [0.0] * len(solution_strs)
        for i, s in zip(todo, self.model.score([prompts[i] for i in todo], [solution_strs[i] for i in todo])):
            rm[i] = s
        if self.pool is None:
            return ScoreResult(scores=rm, model_scores=rm)
        infos = [{**(e or {}), "rm_score": s} for e, s in zip(extra_infos, rm)]
        result = self.pool.score_batch(data_sources, solution_strs, ground_truths, infos)
        result.model_scores = rm
        return result

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
