"""The files the plan renders for the roles (dscplan.rendered): the hostfile and .deepspeed_env
against DeepSpeed's parsers, and the code archive a run ships.

    .venv/bin/pytest tests/unit/test_plan_rendered.py -q
"""
import base64
import io
import tarfile

import pytest

import dscplan


def test_code_archive_holds_the_code_without_caches(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "train.py").write_text("print('hi')\n")
    (tmp_path / "pkg" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"x")
    data = base64.b64decode(dscplan.code_archive(tmp_path / "pkg"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert "./train.py" in names and not any("__pycache__" in n for n in names)


@pytest.mark.parametrize("text,needle", [
    ("a slots=1\n\nb slots=2\n", None),
    ("a slots = 1\n", "bad entry"),
    ("a slots=1\na slots=2\n", "multiple entries"),
    ("# only a comment\n", "empty"),
])
def test_hostfile_parsing_follows_deepspeed(text, needle):
    if needle is None:
        assert dscplan.parse_hostfile(text) == [("a", 1), ("b", 2)]
    else:
        with pytest.raises(ValueError, match=needle):
            dscplan.parse_hostfile(text)


@pytest.mark.parametrize("text,needle", [("A=1\n\nB=2\n", "no '='"), ("# c\n", "no '='"),
                                         ("export A=1\n", "not a plain variable name")])
def test_env_file_lines_that_break_deepspeed_are_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        dscplan.parse_ds_env(text)
