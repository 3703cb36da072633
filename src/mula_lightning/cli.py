"""The ``mula`` console script: one dispatcher in front of every subcommand.

``mula <command> [args...]`` looks ``<command>`` up in :data:`COMMANDS` and hands the remaining arguments to
that command's ``main(argv)``. Training commands (``fit``, ``validate``, ``test``) are served by LightningCLI;
the others (``models``, ``data``, ``upcycle``, ``report``, ...) by jsonargparse parsers in their own modules.
Each module is imported only when its command runs, so ``mula --help`` stays fast and a command's heavy
dependencies never slow down another one.

To add a command, add one entry to :data:`COMMANDS`; the target is ``"package.module:function"`` and the
function takes the argument list (without the command name) and returns an exit code (or None).

Errors: a bad input (a missing or unreadable file, a value that does not fit, an unknown option) found before any
process starts is answered with one line on stderr naming the values, ``mula <command>: error: <message>``, and
exit code 1; an unexpected exception also gets one line, marked as an internal error. A failure after a run started
(:class:`~mula_lightning.utils.run_failure.RunFailure`: an out-of-memory or NCCL error at step 50,000, a bug in a
training step) is printed with its traceback, every line prefixed with the rank, once per rank, then the one line.
Other tracebacks are shown only with ``--debug`` (anywhere on the command line) or ``MULA_DEBUG=1``, for bug
reports. Argument parsing errors keep jsonargparse's exit code 2.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from mula_lightning.utils.env_flags import env_flag

#: exit code of a command that refused its input (or failed) with a one-line message
EXIT_ERROR = 1
#: what a bad input raises across the package (file errors, values that do not fit, unknown keywords or keys, a
#: corrupt checkpoint: ``CheckpointIntegrityError`` / ``CheckpointWriteError``, named to keep this import-light), and
#: what Lightning raises for a configuration it refuses (``MisconfigurationException``: options that contradict each
#: other, such as ``enable_checkpointing: false`` beside a checkpoint callback): the user's mistake, not ours
INPUT_ERRORS = (ValueError, TypeError, KeyError, OSError)
INPUT_ERROR_NAMES = {"CheckpointIntegrityError", "CheckpointWriteError", "MisconfigurationException"}

#: command name -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("mula_lightning.models.cli:main", "list the model presets with their parameter counts"),
    "data": ("mula_lightning.data.cli:main", "prepare token shards: mula data prepare --help"),
    "upcycle": ("mula_lightning.models.upcycle_cli:main", "turn a dense checkpoint into an MoE"),
    "fit": ("mula_lightning.lightning_cli:fit", "train with LightningCLI: mula fit --config examples/configs/..."),
    "validate": ("mula_lightning.lightning_cli:validate", "validation loss and perplexity of a checkpoint"),
    "test": ("mula_lightning.lightning_cli:test", "evaluate a checkpoint on the held-out split"),
    "report": ("mula_lightning.report:main", "PNG plots (loss, lr, tokens/s, expert load) of a run's CSV log"),
    "export": ("mula_lightning.checkpoint.export:main", "any checkpoint (full or model-only) to a HF directory"),
    "launch": ("mula_lightning.launch.cli:main", "run a command on N nodes; relaunch it around failed nodes"),
    "checkpoint": ("mula_lightning.checkpoint.cli:main", "convert a checkpoint of the earlier pickled format: --trust"),
    "plan": ("mula_lightning.plan.cli:main", "memory, bytes per link, step time of a layout; --search, --trace"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: mula <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items())]
    lines += ["", "Run `mula <command> --help` for the arguments of one command; --debug shows tracebacks."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mula`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"mula: unknown command {name!r}; known commands: {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    try:
        debug = "--debug" in rest or env_flag("MULA_DEBUG", False)
    except ValueError as err:
        print(f"mula {name}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    rest = [a for a in rest if a != "--debug"]
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        code = func(rest)
        if argv is None:
            skip_exit_collection()
    except Exception as err:  # one line for the user; the traceback with --debug or after a run started
        if debug:
            raise
        if type(err).__name__ == "RunFailure":  # after the run started: the traceback, then one line
            print(err.report, end="", file=sys.stderr, flush=True)
            print(f"mula {name}: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        print(f"mula {name}: error: {error_line(err)}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    return int(code or 0)


def skip_exit_collection() -> None:
    """Leave the objects of a finished command to the process's exit instead of a last garbage collection: over a
    trained model's objects that collection took 4-5 s per rank on 2 busy cores, time a launcher waits (and its hang
    timeout counts) before the process ends. Only where the process ends next (the console script; a warm spare):
    objects frozen in a longer-lived process would never be collected. ``atexit`` handlers still run."""
    import gc

    gc.freeze()


def is_input_error(err: BaseException) -> bool:
    """Whether ``err`` reports a bad input (see :data:`INPUT_ERRORS`) rather than a bug."""
    return isinstance(err, INPUT_ERRORS) or type(err).__name__ in INPUT_ERROR_NAMES


def error_line(err: BaseException) -> str:
    """The one-line message of ``err``: its text for a bad input, marked as internal (with its type) otherwise."""
    text = err.args[0] if len(err.args) == 1 and isinstance(err.args[0], str) else str(err)
    text = " ".join(text.split())  # one line, whatever the message held
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    if is_input_error(err):
        return text
    return f"internal error: {type(err).__name__}: {text} (rerun with --debug and report the traceback)"


if __name__ == "__main__":
    sys.exit(main())
