"""The image datasets' preprocessors (geo3k, clevr, refcoco) and NeMo-RL's vision names in data/named.py, on
literal tiny parquet files written here in the Hub's shape (images made with PIL in memory). No network."""

import io
import random
import re
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.data import named
from posttrain.data.preprocess import clevr, geo3k, refcoco
from posttrain.data.prompts import PromptTemplates
from posttrain.data.schema import read_rows
from posttrain.errors import ConfigError, DataError
from posttrain.rewards import compute_score

Image = pytest.importorskip("PIL.Image")

HUB_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # the datasets library's Image column


def png(color, size=(4, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def write_geo3k(path, rows):
    table = pa.table({"images": pa.array([r[0] for r in rows], pa.list_(HUB_IMAGE)),
                      "problem": [r[1] for r in rows], "answer": [r[2] for r in rows]})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


RED, BLUE, GREEN = png("red"), png("blue"), png("green")
GEO_TRAIN = [([{"bytes": RED, "path": "0.png"}], "<image>Find x. Round to the nearest tenth.", "3.5"),
             ([{"bytes": BLUE, "path": None}, {"bytes": GREEN, "path": None}], "<image>Find y.", "\\frac{1}{2}")]


def test_geo3k_rows_are_verls_with_the_images_bytes_unchanged(tmp_path, capsys):
    write_geo3k(tmp_path / "raw" / "data" / "train-00000-of-00001.parquet", GEO_TRAIN)
    write_geo3k(tmp_path / "raw" / "data" / "test-00000-of-00001.parquet", GEO_TRAIN[:1])
    assert main(["preprocess", "geo3k", "--input", str(tmp_path / "raw" / "data"), "--output-dir",
                 str(tmp_path / "out")]) == 0
    assert "train.parquet (2 rows)" in capsys.readouterr().out
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert rows[0] == {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "<image>Find x. Round to the nearest tenth. " + geo3k.INSTRUCTION}],
        "images": [{"bytes": RED, "path": "0.png"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3.5"},
        "extra_info": {"split": "train", "index": 0, "answer": "3.5",
                       "question": "<image>Find x. Round to the nearest tenth."}}
    assert rows[1]["images"] == [{"bytes": BLUE, "path": None}, {"bytes": GREEN, "path": None}]  # every image
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert "think about the reasoning process" in geo3k.INSTRUCTION and geo3k.INSTRUCTION.endswith("\\boxed{}.")
    test = read_rows(tmp_path / "out" / "test.parquet")  # a run reads them, images included
    assert test[0]["extra_info"]["split"] == "test" and test[0]["images"][0]["bytes"] == RED
    # and verl's reward scores them
    assert compute_score(rows[0]["data_source"], "<think>x</think> \\boxed{3.5}", "3.5") == 1.0


def test_geo3k_nemo_rl_style_is_its_geometry3k_task(tmp_path):
    write_geo3k(tmp_path / "train-00000-of-00001.parquet", GEO_TRAIN)
    (path,) = geo3k.run([tmp_path / "train-00000-of-00001.parquet"], tmp_path / "out", style="nemo-rl")
    rows = pq.read_table(path).to_pylist()
    assert rows[1]["data_source"] == "geometry3k" and rows[1]["images"] == [{"bytes": BLUE, "path": None}]  # first
    content = rows[1]["prompt"][0]["content"]
    assert content == "<image>" + geo3k.NEMO_RL_PROMPT.format("Find y.")  # the image first, then NeMo-RL's text
    assert content.count("<image>") == 1 and "<answer> only answer here </answer>" in content
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, "answer": "\\frac{1}{2}", "problem": "Find y."}
    assert compute_score("geometry3k", "<think>t</think><answer>0.5</answer>", "\\frac{1}{2}")["score"] == \
        pytest.approx(1.0)


def test_geo3k_input_errors(tmp_path):
    with pytest.raises(DataError, match=r"geometry3k input '.*nothing' does not exist; pass the Hub dataset"):
        geo3k.run([tmp_path / "nothing"], tmp_path / "out")
    pq.write_table(pa.table({"problem": ["x"], "answer": ["1"]}), tmp_path / "train-0.parquet")
    with pytest.raises(DataError, match=r"lacks column\(s\) images \(it has: problem, answer\)"):
        geo3k.run([tmp_path / "train-0.parquet"], tmp_path / "out")
    write_geo3k(tmp_path / "d" / "mine.parquet", GEO_TRAIN)
    with pytest.raises(DataError, match=r"cannot tell the split .*mine.parquet'; name it train-\*"):
        geo3k.run([tmp_path / "d"], tmp_path / "out")
    assert geo3k.run([tmp_path / "d"], tmp_path / "out", split="train")[0].name == "train.parquet"
    write_geo3k(tmp_path / "e" / "train-0.parquet", [([{"bytes": None, "path": "x.png"}], "<image>Find x.", "1")])
    with pytest.raises(DataError, match=r"row 0: its image is dict without bytes"):
        geo3k.run([tmp_path / "e"], tmp_path / "out")


def write_clevr(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": pa.array([{"bytes": r[0], "path": None} for r in rows], HUB_IMAGE),
                             "problem": [r[1] for r in rows], "solution": [r[2] for r in rows]}), path)


def test_clevr_rows_hold_nemo_rls_prompt_answer_and_image(tmp_path):
    write_clevr(tmp_path / "raw" / "data" / "train-00000-of-00002.parquet",
                [(RED, "How many cubes are there?", "<answer> 3 </answer>")])
    write_clevr(tmp_path / "raw" / "data" / "train-00001-of-00002.parquet",
                [(BLUE, "Is there a red sphere?", "<answer>yes</answer>")])
    write_clevr(tmp_path / "raw" / "valA" / "data" / "train-00000-of-00001.parquet",
                [(GREEN, "How many cylinders?", "0")])  # ValA's files are named train-* too
    assert main(["preprocess", "clevr", "--train", str(tmp_path / "raw" / "data"), "--test",
                 str(tmp_path / "raw" / "valA" / "data"), "--output-dir", str(tmp_path / "out")]) == 0
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert train[0] == {
        "data_source": "clevr-cogent",
        "prompt": [{"role": "user", "content": "<image>" + clevr.PROMPT.format("How many cubes are there?")}],
        "images": [{"bytes": RED, "path": None}],
        "ability": "visual_reasoning",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"split": "train", "index": 0, "problem": "How many cubes are there?",
                       "solution": "<answer> 3 </answer>"}}
    assert (train[1]["reward_model"]["ground_truth"], train[1]["extra_info"]["index"]) == ("yes", 1)  # both files
    assert train[1]["images"][0]["bytes"] == BLUE
    test = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert test[0]["reward_model"]["ground_truth"] == "0" and test[0]["extra_info"]["split"] == "test"
    assert clevr.PROMPT.startswith("Think step-by-step") and "<answer> final answer </answer>" in clevr.PROMPT
    with pytest.raises(DataError, match="no CLEVR input; pass the parquet files"):
        clevr.run((), (), tmp_path / "out")


def coco_image(path, size, color="red"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, format="JPEG")


def write_refcoco(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image_path": [r[0] for r in rows], "captions": [r[1] for r in rows],
                             "bbox": [r[2] for r in rows], "split": [r[3] for r in rows],
                             "raw_anns": ["{}" for _ in rows]}), path)


def test_refcoco_rows_hold_the_box_in_thousandths_and_a_resized_image(tmp_path):
    raw = tmp_path / "raw"
    coco_image(raw / "train2014" / "COCO_train2014_1.jpg", (640, 480))
    coco_image(raw / "train2014" / "COCO_train2014_2.jpg", (200, 100), "blue")
    captions = ["man left", "guy on the left in blue", "left guy"]
    write_refcoco(raw / "data" / "train-00000-of-00001.parquet",
                  [("coco/train2014/COCO_train2014_1.jpg", captions, [64.0, 120.0, 320.0, 480.0], "train"),
                   ("coco/train2014/COCO_train2014_2.jpg", ["dog"], [10.0, 10.0, 30.5, 99.0], "train")])
    write_refcoco(raw / "data" / "validation-00000-of-00001.parquet",
                  [("coco/train2014/COCO_train2014_1.jpg", captions, [0.0, 0.0, 640.0, 480.0], "val")])
    assert main(["preprocess", "refcoco", "--input", str(raw / "data"), "--images-dir", str(raw), "--output-dir",
                 str(tmp_path / "out"), "--seed", "3"]) == 0
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    # 64/640, 120/480, 320/640, 480/480 in thousandths
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "[100, 250, 500, 1000]"}
    # 10/200 = 50, 10/100 = 100, 30.5/200 = 152.5 -> 152 (round half to even, as NeMo-RL's round), 99/100 = 990
    assert train[1]["reward_model"]["ground_truth"] == "[50, 100, 152, 990]"
    drawn = random.Random(3).choice(captions)  # training rows: a caption drawn with the seed
    assert train[0]["extra_info"]["caption"] == drawn
    assert train[0]["prompt"][0]["content"] == "<image>" + refcoco.PROMPT.format(refcoco.ASK + drawn)
    image = Image.open(io.BytesIO(train[0]["images"][0]["bytes"]))
    assert (image.format, image.size) == ("PNG", (256, 256))  # NeMo-RL's resize
    assert train[0]["images"][0]["path"] == "coco/train2014/COCO_train2014_1.jpg"
    assert train[0]["data_source"] == "refcoco" and train[0]["ability"] == "grounding"
    val = pq.read_table(tmp_path / "out" / "validation.parquet").to_pylist()
    assert val[0]["extra_info"]["caption"] == "guy on the left in blue"  # validation: the longest caption
    assert val[0]["reward_model"]["ground_truth"] == "[0, 0, 1000, 1000]"
    # the refcoco reward reads the box back: the whole image, answered exactly
    assert compute_score("refcoco", "<think>t</think><answer>[0, 0, 1000, 1000]</answer>",
                         val[0]["reward_model"]["ground_truth"])["score"] == pytest.approx(1.0)
    with pytest.raises(DataError, match=r"no image .*train2014/COCO_train2014_1.jpg; pass the Hub dataset "
                                        r"jxu124/refcoco's parquet files"):
        refcoco.run([raw / "data"], tmp_path, tmp_path / "out2")


# ---------------------------------------------------------------- named datasets

@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def test_geometry3k_by_name_names_its_download_and_nemo_rl_preprocessing(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("geometry3k", "train")
    raw, out = data_dir / "raw" / "geometry3k", data_dir / "geometry3k"
    assert str(e.value) == (
        f"data.dataset_name=geometry3k: no {out / 'train.parquet'}; download data/* from the Hub dataset "
        f"hiyouga/geometry3k with `hf download hiyouga/geometry3k --include 'data/*' --repo-type dataset "
        f"--local-dir {raw}` and run `posttrain preprocess geo3k --input {raw / 'data'} --style nemo-rl "
        f"--output-dir {out}`")
    # what the download writes, then the command as the error gives it: the rows a run reads
    write_geo3k(raw / "data" / "train-00000-of-00001.parquet", GEO_TRAIN)
    write_geo3k(raw / "data" / "test-00000-of-00001.parquet", GEO_TRAIN[:1])
    (command,) = [c for c in re.findall(r"`([^`]+)`", str(e.value)) if c.startswith("posttrain preprocess")]
    assert main(shlex.split(command)[1:]) == 0
    rows = read_rows(named.resolve("geometry3k", "train"))
    assert rows[0]["data_source"] == "geometry3k" and rows[0]["images"][0]["bytes"] == RED
    assert named.default_validation("geometry3k") == out / "test.parquet"  # NeMo-RL's recipes: its test split


def test_clevr_and_refcoco_by_name_name_every_download(data_dir):
    with pytest.raises(DataError) as e:
        named.resolve("clevr-cogent", "test")
    raw, out = data_dir / "raw" / "clevr-cogent", data_dir / "clevr-cogent"
    assert str(e.value) == (
        f"data.val_dataset_name=clevr-cogent: no {out / 'test.parquet'}; download data/* from the Hub dataset "
        "MMInstruction/Clevr_CoGenT_TrainA_70K_Complex with `hf download MMInstruction/Clevr_CoGenT_TrainA_70K_Complex "
        f"--include 'data/*' --repo-type dataset --local-dir {raw}`, download data/* from the Hub dataset "
        "MMInstruction/Clevr_CoGenT_ValA with `hf download MMInstruction/Clevr_CoGenT_ValA --include 'data/*' "
        f"--repo-type dataset --local-dir {raw / 'valA'}`, and run `posttrain preprocess clevr --train "
        f"{raw / 'data'} --test {raw / 'valA' / 'data'} --output-dir {out}`")
    with pytest.raises(DataError) as e:
        named.resolve("refcoco", "test")
    raw, out = data_dir / "raw" / "refcoco", data_dir / "refcoco"
    assert str(e.value).startswith(f"data.val_dataset_name=refcoco: no {out / 'validation.parquet'}; download data/*")
    assert str(e.value).endswith(
        f", get COCO's train2014 images with `curl -L -o {raw / 'train2014.zip'} "
        f"http://images.cocodataset.org/zips/train2014.zip` and `unzip -q {raw / 'train2014.zip'} -d {raw}`, and run "
        f"`posttrain preprocess refcoco --input {raw / 'data'} --images-dir {raw} --output-dir {out}`")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["mmpr-tiny", "avqa", "audiomcq", "daily-omni"])
def test_nemo_rls_other_media_sets_are_not_supported_yet(name):
    with pytest.raises(ConfigError) as e:
        named.lookup(name)
    assert "not supported yet" in str(e.value) and "text only" not in str(e.value)


def test_a_prompt_file_keeps_the_rows_image_placeholder_first():
    t = PromptTemplates(geo3k.NEMO_RL_PROMPT)
    msgs = [{"role": "user", "content": "<image>" + geo3k.NEMO_RL_PROMPT.format("Find y.")}]
    assert t.apply(msgs, {"problem": "Find y."}) == msgs  # NeMo-RL's file over its own rows: the same text
    got = PromptTemplates("Solve: {}")
    assert got.apply([{"role": "user", "content": "<image>Find x. " + geo3k.INSTRUCTION}],
                     {"question": "<image>Find x."})[0]["content"] == "Solve: <image>Find x."  # it had its own
    assert got.apply([{"role": "user", "content": "2+2?"}], {"problem": "2+2?"})[0]["content"] == "Solve: 2+2?"
