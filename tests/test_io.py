"""Atomic writes leave results with the modes a plain open()/mkdir() gives under the umask, not
the 0600 / 0700 of their temp files (colleagues on a shared cluster read them)."""

import os
import stat

import pytest

from harness.base.io import make_temp_dir, write_json_atomic, write_text_atomic


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize(
    "mask, file_mode, dir_mode",
    [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)],
)
def test_results_take_the_umask_mode(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    text = write_text_atomic(tmp_path / "a" / "config.yaml", "x: 1\n")
    js = write_json_atomic(tmp_path / "meta.json", {"a": 1})
    folder = make_temp_dir("model.tmp-", tmp_path)
    assert stat.S_IMODE(text.stat().st_mode) == file_mode and text.read_text() == "x: 1\n"
    assert stat.S_IMODE(js.stat().st_mode) == file_mode
    assert stat.S_IMODE(folder.stat().st_mode) == dir_mode and folder.parent == tmp_path
    assert not list((tmp_path / "a").glob("*.tmp"))  # the temp file was renamed, not copied
