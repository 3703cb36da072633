"""``mula fit | validate | test``: LightningCLI over :class:`MulaLM` and :class:`MulaDataModule`.

Everything comes from YAML (or flags): ``model`` (the :class:`MulaLM` arguments), ``data`` (the
:class:`MulaDataModule` arguments), ``trainer`` (devices, strategy with its arguments, precision, steps,
loggers, callbacks) and six always-on callbacks, ``moe_stats`` (:class:`MoEStats`), ``throughput``
(:class:`MulaThroughput`), ``last_step`` (:class:`LastStepLogger`: the final step's metrics are logged and flushed
whatever ``log_every_n_steps`` is) and ``progress`` (:class:`MulaProgress`: a line per logging interval on rank 0
when the output is not a terminal, Lightning's bar when it is) and ``stop`` (:class:`GracefulStop`: SIGTERM, SIGUSR1
or Ctrl-C saves at the next step boundary, says where a resume starts, and ``mula fit`` exits with ``128 + signal``,
never 0) and ``stragglers`` (:class:`StragglerDetection`: every rank's sections timed, the ranks that make the others
wait named every 50 steps in ``stragglers.jsonl`` and the loggers). Examples are in ``examples/configs/``::

    mula fit --config examples/configs/mula-tiny-moe.yaml
    mula fit --config examples/configs/mula-tiny-moe.yaml --trainer.max_steps 50 --model.lr 1e-3
    torchrun --nproc-per-node 4 -m mula_lightning.cli fit --config examples/configs/mula-tiny-moe.yaml

What fails before any process is started, and how (one line on stderr, exit code 1; ``--debug`` for tracebacks;
what fails once training started is printed with its traceback, rank-prefixed: :mod:`mula_lightning.utils.run_failure`):

* a key the classes do not accept (a typo in the YAML): jsonargparse's error names the key (exit code 2);
* a value a class refuses at construction (an unknown ``model_overrides`` field, a strategy keyword);
* everything :func:`mula_lightning.preflight.check_before_launch` checks, in the launching process between
  instantiation and ``trainer.fit``: the data folder and its manifest, the vocabulary against the data, ``ep_size``
  against the experts and the number of processes, the global batch against micro-batch x ranks x accumulation,
  ``model.init_from``.

Loggers: unless the config names its own, a :class:`CSVLogger` (the source of ``mula report``) and a
:class:`WandbLogger` (offline unless an API key is configured: ``WANDB_API_KEY`` or a ``wandb login`` entry in
``~/.netrc``; ``WANDB_MODE`` wins when set) both write under ``runs/`` (``trainer.default_root_dir``'s parent
layout: ``runs/<name>/version_N/`` holds ``metrics.csv``, ``config.yaml`` and ``checkpoints/``).
"""

from __future__ import annotations

import logging
import netrc
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningCLI

RUNS_DIR = "runs"
#: what a stage raises after the preflight checks for the user's options, not for a failure of the run: Lightning's
#: refusal of a configuration (a loop's or a strategy's set-up) and a resume that changes the checkpoint's schedule
USER_ERRORS_AFTER_START = {"MisconfigurationException", "ScheduleChangeError"}


def wandb_offline() -> bool:
    """W&B runs offline unless the user configured an API key (or set ``WANDB_MODE`` themselves)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode in ("offline", "disabled", "dryrun")
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return True


def default_loggers(save_dir: str = RUNS_DIR, name: str = "mula") -> list[dict[str, Any]]:
    """CSV (for ``mula report``) and W&B (offline unless configured), as LightningCLI class specs."""
    return [
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": save_dir, "name": name}},
        {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"save_dir": save_dir, "project": name, "offline": wandb_offline()},
        },
    ]


def launch_callbacks() -> list[Any]:
    """The callbacks ``mula launch`` and failure drills need, only when their variables are set: ``Heartbeat``
    (``MULA_HEARTBEAT``: progress reports for hang detection) and ``FaultInjector`` (``MULA_FAULT``)."""
    from mula_lightning.callbacks.fault_injection import FaultInjector
    from mula_lightning.callbacks.heartbeat import Heartbeat
    from mula_lightning.utils.launch_env import FAULT_ENV, HEARTBEAT_ENV

    out: list[Any] = []
    if os.environ.get(HEARTBEAT_ENV):
        out.append(Heartbeat())
    if os.environ.get(FAULT_ENV):
        out.append(FaultInjector())
    return out


#: configs are read with OmegaConf's interpolation (jsonargparse's ``omegaconf+`` mode): ``${data.seq_len}``,
#: ``${model.model}``, ``${oc.env:SLURM_JOB_ID,local}`` are resolved once every source is merged, so a command-line
#: override reaches the references to its key (``mula fit --config mula-tiny-moe.yaml --model.model
#: mula-tiny-dense`` writes under ``checkpoints/mula-tiny-dense/``); the ``omegaconf`` mode resolved each file alone,
#: against that file's values. Under a subcommand (``fit``) a reference is read relative to the subcommand's keys
#: (:func:`config_parser_kwargs` sets jsonargparse's ``omegaconf_absolute_to_relative_paths``).
CONFIG_PARSER_MODE = "omegaconf+"


def config_parser_kwargs() -> dict[str, Any]:
    """The parser arguments of Mula's configs (``parser_mode``, see :data:`CONFIG_PARSER_MODE`); sets jsonargparse's
    process-wide setting that reads ``${model.model}`` under ``fit`` as the subcommand's own key, and registers the
    resolver ``${mula.wandb_offline:}`` (:func:`wandb_offline`) for a config's own ``WandbLogger``."""
    from jsonargparse import set_parsing_settings
    from omegaconf import OmegaConf

    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    # ${mula.wandb_offline:}: a config's WandbLogger follows the same rule as the default one (offline unless an API
    # key is configured; WANDB_MODE wins), instead of a hard-coded `offline: true` that W&B's own switch could not undo
    # OmegaConf 2.4 renamed register_new_resolver (deprecated there) to register_resolver, which 2.3 has with the
    # old string-argument semantics: take the new-style one of the installed version
    register = OmegaConf.register_resolver if _omegaconf_24() else OmegaConf.register_new_resolver
    register("mula.wandb_offline", wandb_offline, replace=True)
    return {"parser_mode": CONFIG_PARSER_MODE}


def _omegaconf_24() -> bool:
    import omegaconf

    major, minor = (int(part) for part in omegaconf.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


class MulaCLI(LightningCLI):
    """LightningCLI with the MoE statistics, throughput, last-step, progress, stop and straggler callbacks as
    configurable, always-on sections, the configuration checked before launch and short argument errors."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        from mula_lightning.callbacks import (
            GracefulStop,
            LastStepLogger,
            MoEStats,
            MulaProgress,
            MulaThroughput,
            StragglerDetection,
        )

        parser.add_lightning_class_args(MoEStats, "moe_stats")
        parser.add_lightning_class_args(MulaThroughput, "throughput")
        parser.add_lightning_class_args(LastStepLogger, "last_step")
        parser.add_lightning_class_args(MulaProgress, "progress")
        parser.add_lightning_class_args(GracefulStop, "stop")
        parser.add_lightning_class_args(StragglerDetection, "stragglers")

    def init_parser(self, **kwargs: Any) -> Any:
        """LightningCLI's parser, reporting an argument error without the 70-line usage (the error names the key; the
        tip line points to ``--help``)."""
        parser = super().init_parser(**kwargs)
        parser.print_usage = lambda file=None: None
        return parser

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """LightningCLI's Trainer, plus :func:`launch_callbacks` when ``mula launch`` (or a drill) asked for them,
        without Lightning's progress bar where the progress lines replace it (off a terminal), with a model summary
        that counts the whole model (:class:`MulaModelSummary`)."""
        from mula_lightning.callbacks.fault_injection import FaultInjector
        from mula_lightning.callbacks.model_summary import replace_model_summary
        from mula_lightning.callbacks.progress import resolve_progress_bar

        trainer = super().instantiate_trainer(**kwargs)
        for callback in launch_callbacks():  # faults first: a slow rank's stall is timed before its forward
            if isinstance(callback, FaultInjector):
                trainer.callbacks.insert(0, callback)
            else:
                trainer.callbacks.append(callback)
        resolve_progress_bar(trainer)
        replace_model_summary(trainer)  # the whole model's parameters, not rank 0's shard
        for logger in trainer.loggers:
            quiet_wandb_logger(logger)
        return trainer

    def __init__(self, *args: Any, started: list[str] | None = None, **kwargs: Any) -> None:
        #: appended to (with the stage) once the preflight checks passed: what fails later is a run failure
        self.started = started if started is not None else []
        super().__init__(*args, **kwargs)

    def _preflight(self, stage: str) -> None:
        from mula_lightning.preflight import check_before_launch, check_resume

        check_before_launch(self.trainer, self.model, self.datamodule, stage)
        if stage == "fit":
            line = check_resume(self.trainer, self.config.get(f"{self.subcommand}.ckpt_path"))
            if line and os.environ.get("RANK", "0") == "0":  # torchrun / srun start every rank with this command
                print(f"mula fit: {line}", file=sys.stderr, flush=True)
        self.started.append(stage)

    def before_fit(self) -> None:
        """Check the whole configuration before the Trainer starts any process."""
        self._preflight("fit")

    def before_validate(self) -> None:
        self._preflight("validate")

    def before_test(self) -> None:
        self._preflight("test")


class _DropLightningTips(logging.Filter):
    """Drops Lightning's advertisements for its cloud products (``💡 Tip: ... try installing litlogger``): nothing a
    user of this project acts on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning_noise() -> None:
    """Silence what Lightning prints that no user can act on (each process calls it; idempotent): its product tips,
    and the deprecation its own pytree helper triggers in recent torch (``isinstance(treespec, LeafSpec)``, fixed in
    Lightning, not in the user's code)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def quiet_wandb_logger(logger: Any) -> None:
    """Keep a ``WandbLogger`` from making W&B print two warnings nobody can act on: Lightning passes
    ``anonymous=None`` (W&B warns that the setting is deprecated whenever it is given), and W&B looks for a git
    repository at the logger's ``save_dir`` before it exists (created here). Other loggers are left alone."""
    init = getattr(logger, "_wandb_init", None)
    if not isinstance(init, dict):
        return
    if init.get("anonymous") is None:
        init.pop("anonymous", None)
    if init.get("dir"):
        os.makedirs(init["dir"], exist_ok=True)


def build_cli(args: Sequence[str] | dict[str, Any], run: bool = True, started: list[str] | None = None) -> MulaCLI:
    """Parse ``args`` into a :class:`MulaCLI`: ``["fit", "--config", ...]`` when ``run``, else only options (a list
    of flags, or a config dict as the YAML would hold it).

    With ``run=False`` the classes are instantiated but nothing runs (``cli.trainer``, ``cli.model``,
    ``cli.datamodule``), which the tests use to check every shipped YAML. ``started`` receives the stage once the
    preflight checks passed.
    """
    import mula_lightning.strategies  # noqa: F401  (registers "epso" for strategy: epso)
    from mula_lightning.data.datamodule import MulaDataModule
    from mula_lightning.lightning_module import MulaLM

    # `mula fit ...` passes its own arguments (sys.argv minus the command word) while sys.argv still holds them,
    # which is what Lightning's subprocess launcher re-executes: the "both args and command line" warning is noise.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    quiet_lightning_noise()
    mode = config_parser_kwargs()
    return MulaCLI(
        MulaLM,
        MulaDataModule,
        args=dict(args) if isinstance(args, dict) else list(args),
        run=run,
        started=started,
        parser_kwargs={**mode, **{command: mode for command in ("fit", "validate", "test", "predict")}},
        save_config_kwargs={"overwrite": True},
        # no --optimizer / --lr_scheduler: LightningCLI builds them before configure_model (the sharded strategies
        # build the model there), so any choice failed with "an empty parameter list" or was dropped without a word;
        # MulaLM's own options (model.lr, model.betas, model.warmup_steps, ...) set the optimizer and its schedule
        auto_configure_optimizers=False,
        trainer_defaults={"logger": default_loggers(), "default_root_dir": RUNS_DIR},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``mula <fit|validate|test> ...``: ``argv`` starts with the subcommand. Returns the exit status: 0 when the
    stage ran to its end, ``128 + signal`` when a signal stopped it (:class:`GracefulStop` saved the run first, or
    Lightning's ``SIGTERMException`` ended it before the training loop: a ``SystemExit`` without a code, which
    would read as success).

    Under ``mula launch --in-job`` (``MULA_IN_JOB``) ``fit`` runs in the restart loop of
    :func:`~mula_lightning.utils.in_job_restart.run_in_job`: a peer's failure makes this process rejoin the next
    attempt and run the stage again from the newest checkpoint.

    Raises:
        RunFailure: wrapping what escaped the Trainer after the preflight checks passed (its traceback is
            printed by the ``mula`` console script); earlier errors (bad input) propagate unchanged.
    """
    from mula_lightning.callbacks.dual_checkpoint import DualCheckpoint
    from mula_lightning.utils.in_job_restart import in_job_file, run_in_job

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["fit"] and in_job_file() is not None:  # mula launch --in-job: survive a peer's failure
        return run_in_job(_run_stage, args, saved=lambda: DualCheckpoint.completed_in_process > 0)
    return _run_stage(args)


def _run_stage(args: list[str]) -> int:
    """One run of the stage ``args[0]`` (see :func:`main`)."""
    import signal

    from mula_lightning.callbacks.graceful_stop import GracefulStop
    from mula_lightning.utils.dist import release_process_groups
    from mula_lightning.utils.run_failure import RunFailure
    from mula_lightning.utils.stop_request import signal_exit_code

    started: list[str] = []
    try:
        cli = build_cli(args, started=started)
    except SystemExit as exit_:
        if type(exit_).__name__ != "SIGTERMException":
            raise
        print(f"mula: SIGTERM received during {started[-1] if started else 'set-up'}: stopped", file=sys.stderr)
        return signal_exit_code(signal.SIGTERM)
    except Exception as err:
        # Lightning refuses a configuration also once fit began (a strategy's or a loop's set-up), and a resume its
        # checkpoint's schedule: still the user's options, one line naming them
        if started and type(err).__name__ not in USER_ERRORS_AFTER_START:
            raise RunFailure(err) from err
        raise
    stops = [c for c in getattr(cli.trainer, "callbacks", []) if isinstance(c, GracefulStop)]
    release_process_groups()  # the stage ended on every rank: the groups go now, not at the interpreter's exit
    return max((stop.exit_code for stop in stops), default=0)


def fit(argv: Sequence[str]) -> int:
    """``mula fit --config FILE [--section.key value ...]``: train."""
    return main(["fit", *argv])


def validate(argv: Sequence[str]) -> int:
    """``mula validate --config FILE --ckpt_path CKPT``: validation loss and perplexity."""
    return main(["validate", *argv])


def test(argv: Sequence[str]) -> int:
    """``mula test --config FILE --ckpt_path CKPT``: evaluate on the held-out split."""
    return main(["test", *argv])


test.__test__ = False  # not a pytest test when imported into a test module


if __name__ == "__main__":
    sys.exit(main())
