"""`python -m envs.tasks.images build ROWS.jsonl`: every bad row is listed with the field
and the fix, exit 2 and nothing built; good rows (SWE-bench and R2E-Gym field names, the
default repo_dir, requirements as a JSON string) become the ImageSpecs the images are
built from; the argument parsing. The real build is tests/integration/test_images_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.tasks import images
from envs.tasks.images import ImageSpec, main, read_image_rows
from git_repo import calc_repo


@pytest.fixture
def rows_dir(tmp_path: Path) -> tuple[Path, str]:
    """A rows folder with the calc repository at its default place; (folder, commit)."""
    return tmp_path, calc_repo(tmp_path / "repos" / "demo__calc")


def write_rows(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if the command gets as far as looking for a container engine."""
    def refuse() -> None:
        raise AssertionError("bad rows must stop the command before any build")

    monkeypatch.setattr(images.engines, "detect_engine", refuse)


def test_bad_rows_are_all_listed_with_the_fix_and_nothing_is_built(
        rows_dir: tuple[Path, str], no_engine: None, capsys: pytest.CaptureFixture[str]) -> None:
    folder, commit = rows_dir
    rows = write_rows(folder / "rows.jsonl", [
        {"instance_id": "ok", "repo": "demo/calc", "base_commit": commit},
        {"repo": "demo/calc", "base_commit": commit},  # 2: no instance_id
        {"instance_id": "b", "base_commit": commit},  # 3: no repo
        {"instance_id": "c", "repo": "demo/calc"},  # 4: no base_commit
        {"instance_id": "d", "repo": "demo/calc", "base_commit": "0" * 40},  # 5: not a commit
        {"instance_id": "e", "repo": "demo/calc", "base_commit": commit,  # 6: unpinned
         "requirements": ["pytest", "attrs==26.1.0"]},
        {"instance_id": "f", "repo": "demo/nothere", "base_commit": commit},  # 7: no folder
        {"instance_id": "ok", "repo": "demo/calc", "base_commit": commit},  # 8: duplicate
        "not json",  # 9
        {"instance_id": "g", "repo": "calc", "base_commit": commit},  # 10: not owner/name
    ])
    out = folder / "out"
    assert main(["build", str(rows), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "9 problem(s)" in err and "nothing was built" in err
    expected = [
        "row 2, field 'instance_id': is required",
        "row 3, field 'repo': is required: the repository as owner/name",
        "row 4, field 'base_commit': is required",
        f"row 5, field 'base_commit': '{'0' * 40}' is not a commit of",
        "row 6, field 'requirements': ['pytest'] must pin one version each (name==version)",
        "row 7, field 'repo_dir': folder",
        "row 8, field 'instance_id': 'ok' is also row 1's; ids must be unique",
        "row 9: not valid JSON",
        "row 10, field 'repo': must be owner/name, got 'calc'",
    ]
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"
    assert not out.exists()


def test_rows_under_every_published_name_become_image_specs(rows_dir: tuple[Path, str]) -> None:
    folder, commit = rows_dir
    (folder / "elsewhere").mkdir()
    other = calc_repo(folder / "elsewhere" / "calc")
    rows = write_rows(folder / "rows.jsonl", [
        {"instance_id": "swebench", "repo": "demo/calc", "base_commit": commit,
         "problem_statement": "ignored here", "requirements": '["pytest==9.2.0"]'},
        {"instance_id": "r2e", "repo_name": "Demo/Calc.Py", "commit_hash": other[:12],
         "repo_dir": "elsewhere/calc"},
    ])
    specs, problems = read_image_rows(str(rows))
    assert problems == []
    assert [spec for _, spec in specs] == [
        ImageSpec("swebench", "demo/calc", commit, str(folder / "repos" / "demo__calc"), "calc",
                  ("pytest==9.2.0",)),
        ImageSpec("r2e", "Demo/Calc.Py", other, str(folder / "elsewhere" / "calc"),
                  "calc.py", ()),
    ]
    assert specs[1][0]["repo_dir"] == "elsewhere/calc"  # the row as read, for the output


def test_an_empty_or_missing_file_is_an_error(tmp_path: Path, no_engine: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", str(write_rows(tmp_path / "empty.jsonl", []))]) == 2
    assert "holds no rows" in capsys.readouterr().err
    assert main(["build", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["build", "--help"]])
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    assert "usage: python -m envs.tasks.images" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["build"], ["push", "rows.jsonl"]])
def test_missing_or_unknown_arguments_exit_2(argv: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err
