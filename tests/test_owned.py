"""What nbddp trusts on disk is the user's own (nbddp/contracts/owned.py): folders it creates are private, a folder or file
another user owns or can write is refused in one line saying whose it is, and nothing follows a planted link.

Real files; "another user" is uid 65534 (``nobody``), given the files with ``chown`` (the suite runs as root in CI;
elsewhere those cases are skipped).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nbddp.contracts.owned import NotYours, check_owned, private_folder, read_owned, touch

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def test_a_folder_nbddp_creates_is_private_and_one_of_the_users_own_others_can_read_is_made_private_saying_so(tmp_path):
    made = private_folder(tmp_path / "a" / "runs", "the runs folder", parents=True)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    said = []
    for mode, who in ((0o755, "others"), (0o750, "its group")):
        mine = tmp_path / f"mine-{mode:o}"
        mine.mkdir()
        mine.chmod(mode)
        assert private_folder(mine, "--run-dir", say=said.append) == mine and stat.S_IMODE(mine.stat().st_mode) == 0o700
        assert said[-1] == (f"--run-dir {mine} could be read by {who} (mode {stat.filemode(stat.S_IFDIR | mode)}): made "
                            "it private (0700), as nbddp's folders are; share what you want of it with chmod once the "
                            "run ends.")
    private_folder(made, "the runs folder", say=said.append)
    assert len(said) == 2  # (a private one: nothing to say)


def test_a_folder_others_can_write_is_refused_saying_how_to_fix_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NotYours, match=r"--run-dir .*shared can be written by others \(mode drwxrwxrwx\).*chmod go-w"):
        private_folder(shared, "--run-dir")
    shared.chmod(0o770)
    with pytest.raises(NotYours, match="can be written by its group"):
        private_folder(shared, "--run-dir")
    assert NotYours("x").exit_code == 2


@as_root
def test_another_users_folder_or_file_is_refused_naming_the_uid(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(NotYours, match=f"the runs folder .*theirs belongs to uid {NOBODY} .*not to you"):
        private_folder(theirs, "the runs folder")
    planted = tmp_path / "request.json"
    planted.write_text("{}")
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(NotYours, match=f"belongs to uid {NOBODY}"):
        read_owned(planted, "the detached run's request")
    with pytest.raises(NotYours, match="You can follow and stop only runs of your own"):
        check_owned(theirs, "the run", follow=True, then="You can follow and stop only runs of your own.")


def test_a_planted_link_is_never_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    victim.chmod(0o600)
    link = tmp_path / "stop-requested"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        touch(link)  # a mark created through the link would have opened (and could have truncated) the victim
    with pytest.raises(NotYours, match="is a symbolic link"):
        read_owned(link, "the detached run's error")
    with pytest.raises(NotYours, match="is a symbolic link"):
        check_owned(link, "the sharded checkpoint's file")
    assert victim.read_text() == "the user's own file" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    touch(tmp_path / "mark")
    touch(tmp_path / "mark")  # (twice: a mark that exists stays)
    assert (tmp_path / "mark").is_file()


def test_a_folder_that_cant_be_made_is_said_in_one_line(tmp_path):
    from nbddp.contracts.errors import UsageError

    with pytest.raises(UsageError, match=r"^--run-dir /proc/nbddp-nowhere can't be made \(.+\)\. Choose a folder of your own\.$"):
        private_folder(Path("/proc/nbddp-nowhere"), "--run-dir", parents=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="can't be made"):
        private_folder(tmp_path / "file" / "runs", "the runs folder", parents=True)
