"""The ``mula`` console script answers bad input with one line naming the values (exit code 1, no traceback, nothing
written); ``--debug`` / ``MULA_DEBUG=1`` give the exception back; an unexpected exception is marked internal."""

from __future__ import annotations

import pytest

from mula_lightning import cli as mula_cli

MISSING = "input '{tmp}/missing' does not exist"


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"mula {command}: error: "), err
    return err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["export", "{tmp}/notes.txt", "--to", "hf", "{tmp}/out"], "notes.txt: not a torch checkpoint"),
        (["export", "{tmp}/missing", "--to", "hf", "{tmp}/out"], "missing: no such file or directory"),
        (["upcycle", "--from", "{tmp}/notes.txt", "--experts", "4", "--top-k", "2", "--out", "{tmp}/out"], "no config"),
        (["data", "prepare", "--input", "{tmp}/missing", "--output", "{tmp}/out", "--train-tokenizer", "300"], MISSING),
        (["data", "verify", "{tmp}/missing"], "missing/manifest.json not found"),
        (["report", "{tmp}/missing"], "no metrics.csv under {tmp}/missing"),
    ],
    ids=["export-text-file", "export-missing", "upcycle-text-file", "prepare-missing-input", "verify", "report"],
)
def test_bad_inputs_get_one_line_and_write_nothing(tmp_path, capsys, argv, expected):
    """A text file or a missing path given to each single-process command: exit code 1, one line naming the path,
    and no output folder created."""
    (tmp_path / "notes.txt").write_text("hello\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert mula_cli.main(argv) == mula_cli.EXIT_ERROR
    assert expected.format(tmp=tmp_path) in _one_line(capsys, " ".join(argv[:2]) if argv[0] == "data" else argv[0])
    assert not (tmp_path / "out").exists()


def test_argument_errors_are_short(capsys):
    """An unknown option of `mula fit` is named in two lines (the error and where the help is), exit code 2, without
    LightningCLI's 70-line usage."""
    with pytest.raises(SystemExit) as exc:
        mula_cli.main(["fit", "--model.wramup_steps", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--model.wramup_steps" in err[-1] and "--help" in err[0]


def test_debug_gives_the_exception_back(tmp_path, monkeypatch):
    """``--debug`` anywhere on the line, or ``MULA_DEBUG=1``, raises the exception itself (for a bug report)."""
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        mula_cli.main(["export", str(tmp_path / "missing"), "--debug", "--to", "hf", str(tmp_path / "out")])
    monkeypatch.setenv("MULA_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        mula_cli.main(["export", str(tmp_path / "missing"), "--to", "hf", str(tmp_path / "out")])


def test_a_mistyped_debug_switch_is_one_line_naming_it(monkeypatch, capsys):
    """``MULA_DEBUG`` with a value that is no switch (a typo) is refused in one line that names it, before the
    command runs."""
    monkeypatch.setenv("MULA_DEBUG", "ture")
    assert mula_cli.main(["export", "x", "--to", "hf", "y"]) == mula_cli.EXIT_ERROR
    assert "MULA_DEBUG='ture'" in _one_line(capsys, "export")


def test_unexpected_exceptions_are_marked_internal(monkeypatch, capsys):
    """An exception that is not a bad-input error is still one line, with its type and a request for --debug."""

    def broken(argv):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(mula_cli.COMMANDS, "broken", ("tests.test_cli:broken", "a command with a bug"))
    monkeypatch.setattr(mula_cli.importlib, "import_module", lambda name: type("M", (), {"broken": broken}))
    assert mula_cli.main(["broken"]) == mula_cli.EXIT_ERROR
    err = _one_line(capsys, "broken")
    assert "internal error: ZeroDivisionError: division by zero (rerun with --debug" in err
