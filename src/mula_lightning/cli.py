"""The ``mula`` console script: one dispatcher in front of every subcommand.

``mula <command> [args...]`` looks ``<command>`` up in :data:`COMMANDS` and hands the remaining arguments to
that command's ``main(argv)``. Training commands (``fit``, ``validate``, ``test``) are served by LightningCLI;
the others (``models``, ``data``, ``upcycle``, ``report``, ...) by jsonargparse parsers in their own modules.
Each module is imported only when its command runs, so ``mula --help`` stays fast and a command's heavy
dependencies never slow down another one.

To add a command, add one entry to :data:`COMMANDS`; the target is ``"package.module:function"`` and the
function takes the argument list (without the command name) and returns an exit code (or None).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

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
    "checkpoint": ("mula_lightning.checkpoint.cli:main", "convert a checkpoint of the earlier pickled format: --trust"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: mula <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items())]
    lines += ["", "Run `mula <command> --help` for the arguments of one command."]
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
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    code = func(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
