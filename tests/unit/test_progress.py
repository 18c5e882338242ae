"""Long first-use work says what it builds, why, where it is cached and how far it is;
a process waiting for another's build says so instead of going quiet."""

from __future__ import annotations

import io
import logging
import threading
import time

import pytest

from envs.cache import build_lock, build_once
from envs.progress import FirstUse, recorded_builds


def test_a_first_use_build_says_what_where_and_how_far(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="envs.progress"):
        with FirstUse("the warm start", tmp_path / "warm", total=4, every_s=0.0) as progress:
            for _ in range(4):
                progress.advance()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"building the warm start (4 steps): first use, cached in {tmp_path / 'warm'} for later runs"
    assert lines[1].startswith("building the warm start: 1/4 steps, ") and "s left" in lines[1]
    assert lines[-1].startswith("built the warm start in ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_sized_build_keeps_a_bar_and_clears_it(tmp_path, monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    with FirstUse("the warm start", tmp_path / "warm", total=4, every_s=1e9) as progress:
        for _ in range(4):
            progress.advance()
    out = screen.getvalue()
    assert "\rthe warm start [" + "#" * 7 + "." * 23 + "] 1/4 steps, about " in out
    assert "] 4/4 steps, about 0 s left" in out  # the last step is always drawn
    assert out.endswith("\r\033[K")  # cleared: the final log line starts on a clean line


def test_in_a_log_file_there_is_no_bar(tmp_path, monkeypatch):
    log_file = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stderr", log_file)
    with FirstUse("the warm start", tmp_path / "warm", total=4, every_s=1e9) as progress:
        progress.advance(4)
    assert log_file.getvalue() == ""


def test_a_failed_build_says_nothing_was_cached(tmp_path, caplog):
    def broken(_: str) -> None:
        raise RuntimeError("no disk")

    with caplog.at_level(logging.INFO, logger="envs.progress"), pytest.raises(RuntimeError):
        build_once(str(tmp_path / "set"), broken, "the task set")
    assert "building the task set failed after" in caplog.records[-1].getMessage()
    assert not (tmp_path / "set").exists()


def test_waiting_for_another_builder_is_said(tmp_path, caplog):
    held = threading.Event()

    def builder() -> None:
        with build_lock(tmp_path / "model"):
            held.set()
            time.sleep(0.3)

    thread = threading.Thread(target=builder)
    thread.start()
    held.wait(5)
    with caplog.at_level(logging.INFO, logger="envs.cache"), build_lock(tmp_path / "model"):
        pass
    thread.join()
    assert caplog.records[0].getMessage() == \
        f"waiting for another process to finish building {tmp_path / 'model'}"


def test_each_build_is_recorded_for_the_run_report(tmp_path):
    before = time.time()
    with FirstUse("the tiny model", tmp_path / "tiny"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), FirstUse("the task set", tmp_path / "set"):
        raise RuntimeError("no disk")
    *_, built, failed = recorded_builds()
    assert (built.what, built.where, built.ok) == ("the tiny model", str(tmp_path / "tiny"), True)
    assert before <= built.t0 and built.t1 - built.t0 >= 0.01 and built.t1 <= failed.t0
    assert (failed.what, failed.ok) == ("the task set", False)
