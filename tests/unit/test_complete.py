"""Which checkpoint tag a load without one takes (dscnode.complete): the newest complete on every
node, from the marks the entry shim writes after each save. The shim's patch itself runs on two
"nodes" of this machine in tests/local/test_train.py."""
from dscnode import complete


def marked(folder, *tags, folders=None):
    folder.mkdir(parents=True, exist_ok=True)
    for t in tags:
        complete.mark(folder, t)
    for t in folders if folders is not None else tags:
        (folder / t).mkdir(exist_ok=True)
    return complete.tags(folder)


def test_the_newest_tag_on_every_node_is_agreed(tmp_path):
    a = marked(tmp_path / "a", "global_step4", "global_step8", "global_step12")
    b = marked(tmp_path / "b", "global_step4", "global_step8")  # cut short at 12: no mark
    assert complete.agreed([a, b]) == complete.agreed([b, a]) == "global_step8"
    assert complete.agreed([a, a]) == "global_step12"


def test_a_tag_saved_again_is_the_newest_and_a_removed_folder_is_no_checkpoint(tmp_path):
    assert marked(tmp_path / "a", "last", "best", "last") == ["best", "last"]
    # retention removed global_step4's folder: its mark alone is no checkpoint
    assert marked(tmp_path / "b", "global_step4", "global_step8", folders=["global_step8"]) == ["global_step8"]


def test_no_common_tag_and_no_marks_are_told_apart(tmp_path):
    a = marked(tmp_path / "a", "global_step4")
    b = marked(tmp_path / "b", "global_step8")
    assert complete.agreed([a, b]) == ""  # marks, none complete everywhere: start without one
    assert complete.tags(tmp_path / "none") is None
    assert complete.agreed([None, None]) is None  # saved without the shim: DeepSpeed's own latest


def test_only_the_tail_of_a_long_mark_file_is_read(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / complete.MARKS).write_text("".join(f"global_step{i}\n" for i in range(20000)))
    (folder / "global_step19999").mkdir()
    (folder / "global_step3").mkdir()  # only in the file's head
    assert complete.tags(folder) == ["global_step19999"]
