"""rewards/vlm.py: NeMo-RL's VLM reward functions and their weighted sum, verl's geometry3k reward, on cases
computed by hand (the arithmetic is in the comments)."""

import pytest

from posttrain.rewards import REWARD_FNS, compute_score, vlm

BOTH = "<think>count them</think> <answer>{}</answer>"


def test_format_is_a_quarter_for_think_and_three_quarters_for_answer():
    assert vlm.format_score(BOTH.format("3")) == 1.0
    assert vlm.format_score("<answer>3</answer>") == 0.75
    assert vlm.format_score("<think>hm</think> 3") == 0.25
    assert vlm.format_score("3") == 0.0
    assert vlm.format_score("<think>hm</think> <answer>3") == 0.25  # an answer never closed is no answer
    assert vlm.format_score("text before <think>x\ny</think>\n<answer>\n3\n</answer> after") == 1.0  # anywhere


def test_exact_alnum_compares_letters_and_digits_case_folded():
    assert vlm.exact_alnum(BOTH.format("3"), "3") == 1.0
    assert vlm.exact_alnum("<answer> Yes. </answer>", "yes") == 1.0  # NeMo-RL folds case, drops punctuation
    assert vlm.exact_alnum(BOTH.format("no"), "yes") == 0.0  # wrong
    assert vlm.exact_alnum(BOTH.format("13"), "3") == 0.0
    assert vlm.exact_alnum("the answer is 3", "3") == 0.0  # malformed: no answer tags
    # greedy, as NeMo-RL: first <answer> to last </answer>, so two answers run together
    assert vlm.exact_alnum("<answer>1</answer><answer>2</answer>", "2") == 0.0
    assert vlm.exact_alnum("<answer>1</answer><answer>2</answer>", "1answeranswer2") == 1.0


def test_math_expr_checks_equivalence_with_math_verify():
    assert vlm.math_expr(BOTH.format("\\frac{1}{2}"), "0.5") == 1.0
    assert vlm.math_expr(BOTH.format("2\\sqrt{2}"), "\\sqrt{8}") == 1.0
    assert vlm.math_expr(BOTH.format("0.33"), "\\frac{1}{3}") == 0.0  # wrong
    assert vlm.math_expr("<answer>\\frac{1}{2}", "0.5") == 0.0  # malformed: never closed
    assert vlm.math_expr(BOTH.format("\\frac{"), "0.5") == 0.0  # unparsable
    assert vlm.math_expr(BOTH.format("1" * 2000), "1" * 2000) == 0.0  # over the cap: not parsed


def test_giou_of_literal_boxes():
    # overlapping: two 2x2 boxes sharing a 1x1 corner. union 4 + 4 - 1 = 7, IoU 1/7; enclosing box 3x3 = 9:
    # GIoU = 1/7 - (9 - 7)/9 = 9/63 - 14/63 = -5/63
    assert vlm.giou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(-5 / 63)
    # disjoint: unit boxes at (0,0) and (2,2). IoU 0, union 2, enclosing 9: 0 - 7/9
    assert vlm.giou((0, 0, 1, 1), (2, 2, 3, 3)) == pytest.approx(-7 / 9)
    # identical: IoU 1, enclosing box = union: 1
    assert vlm.giou((1, 2, 3, 4), (1, 2, 3, 4)) == pytest.approx(1.0)
    # IoU 81/119 (10x10 boxes offset by 1: inter 9*9, union 200 - 81), enclosing 11x11 = 121:
    # GIoU 81/119 - 2/121; with NeMo-RL's refcoco threshold 0.5 the IoU (>= 0.5) is the reward as it is
    assert vlm.giou((0, 0, 10, 10), (1, 1, 11, 11)) == pytest.approx(81 / 119 - 2 / 121)
    assert vlm.giou((0, 0, 10, 10), (1, 1, 11, 11), giou_penalty_thres=0.5) == pytest.approx(81 / 119)
    # degenerate boxes: the areas count at least 0.001 (NeMo-RL's floor), no division by zero
    assert vlm.giou((1, 1, 1, 1), (1, 1, 1, 1)) == 0.0


def test_bbox_giou_reads_the_answers_box():
    assert vlm.bbox_giou(BOTH.format("[0, 0, 2, 2]"), "[1, 1, 3, 3]") == pytest.approx(-5 / 63)
    assert vlm.bbox_giou(BOTH.format("[120, 40, 380, 500]"), "[120, 40, 380, 500]") == pytest.approx(1.0)
    assert vlm.bbox_giou(BOTH.format("0,0,2,2"), "[1, 1, 3, 3]") == pytest.approx(-5 / 63)  # brackets optional
    assert vlm.bbox_giou(BOTH.format("[1, 2, 3]"), "[1, 2, 3, 4]") == 0.0  # three numbers
    assert vlm.bbox_giou(BOTH.format("the cat"), "[1, 2, 3, 4]") == 0.0
    assert vlm.bbox_giou(BOTH.format("[nan, 0, 1, 1]"), "[0, 0, 1, 1]") == 0.0
    assert vlm.bbox_giou("[0, 0, 2, 2]", "[0, 0, 2, 2]") == 0.0  # malformed: no answer tags


def test_nemo_rls_weighted_sums_with_vlm_grpo_3Bs_weights():
    # clevr: 0.2 format + 0.8 exact_alnum
    assert compute_score("clevr-cogent", BOTH.format("3"), "3") == {"score": 1.0, "format": 1.0, "exact_alnum": 1.0}
    got = compute_score("clevr-cogent", "<answer>3</answer>", "3")  # 0.2 * 0.75 + 0.8 * 1 = 0.95
    assert got["score"] == pytest.approx(0.95) and (got["format"], got["exact_alnum"]) == (0.75, 1.0)
    assert compute_score("clevr-cogent", BOTH.format("4"), "3")["score"] == pytest.approx(0.2)  # wrong: format only
    assert compute_score("clevr-cogent", "3", "3")["score"] == 0.0  # malformed
    # geometry3k: 0.1 format + 0.9 math_expr
    assert compute_score("geometry3k", BOTH.format("\\frac{1}{2}"), "0.5")["score"] == pytest.approx(1.0)
    assert compute_score("geometry3k", BOTH.format("1"), "0.5")["score"] == pytest.approx(0.1)
    # refcoco: 0.1 format + 0.9 bbox_giou, IoU from 0.5 up: 0.1 * 1 + 0.9 * (-5/63) = 0.1 - 0.5/7
    got = compute_score("refcoco", BOTH.format("[0, 0, 2, 2]"), "[1, 1, 3, 3]")
    assert got["score"] == pytest.approx(0.1 - 0.5 / 7) and got["bbox_giou"] == pytest.approx(-5 / 63)
    got = compute_score("refcoco", BOTH.format("[0, 0, 10, 10]"), "[1, 1, 11, 11]")  # IoU 81/119 >= 0.5: IoU
    assert got["score"] == pytest.approx(0.1 + 0.9 * 81 / 119)


def test_combine_divides_the_weights_by_their_sum_and_takes_kwargs():
    score = vlm.combine([("format", 1), ("exact_alnum", 3)])("<answer>no</answer>", "No")
    assert score == {"score": pytest.approx(0.25 * 0.75 + 0.75 * 1.0), "format": 0.75, "exact_alnum": 1.0}
    strict = vlm.combine([("bbox_giou", 2.0, {"giou_penalty_thres": 0.5})])
    assert strict(BOTH.format("[0, 0, 10, 10]"), "[1, 1, 11, 11]")["score"] == pytest.approx(81 / 119)
    with pytest.raises(ValueError, match="no VLM reward function 'iou'; NeMo-RL's are format, exact_alnum"):
        vlm.combine([("iou", 1.0)])
    with pytest.raises(ValueError, match="have no weight"):
        vlm.combine([("format", 0)])


def test_verls_geo3k_is_nine_tenths_accuracy_and_a_tenth_format():
    assert compute_score("hiyouga/geometry3k", "<think>x = 2</think> so \\boxed{2}", "2") == 1.0
    assert compute_score("hiyouga/geometry3k", "<think>t</think> \\boxed{3}", "2") == pytest.approx(0.1)  # wrong
    assert compute_score("hiyouga/geometry3k", "x is \\boxed{2}", "2") == pytest.approx(0.9)  # no <think>
    assert compute_score("hiyouga/geometry3k", "so <think>t</think> \\boxed{2}", "2") == pytest.approx(0.9)  # verl:
    # the whole response must start with <think>
    assert compute_score("hiyouga/geometry3k", "<think>t</think> 2", "2") == 0.0  # no boxed answer
    assert compute_score("hiyouga/geometry3k", "<think>t</think> \\boxed{2", "2") == 0.0  # never closed
    assert compute_score("hiyouga/geometry3k", "<think>t</think> \\boxed{1}, no: \\boxed{\\frac{4}{2}}", "2") == 1.0
    assert REWARD_FNS["hiyouga/geometry3k"] is vlm.compute_score_geo3k
