"""The constructors and the declared protocol of the sharding strategies, Fabric and Trainer flavours alike.

Every strategy takes its own options as explicit typed arguments (so ``mula fit --help`` / ``--print_config`` show
them), forwards only the Lightning DDP arguments that mean something without a DDP wrapper, and refuses every other
keyword with a ``TypeError`` naming it; every Lightning hook it overrides is marked ``@override``; and it answers
``MulaLM`` through :class:`~mula_lightning.strategies.protocol.ShardingStrategy`.
"""

import inspect
from datetime import timedelta

import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy

from mula_lightning.strategies import EPSOStrategy, FabricEPSOStrategy, FabricZeroTopoStrategy, ZeroTopoStrategy
from mula_lightning.strategies.common import InPlaceCheckpointRestore, ShardedFabricHooks
from mula_lightning.strategies.epso import EPSOOptions
from mula_lightning.strategies.protocol import ShardingStrategy, strategy_ep_size
from mula_lightning.strategies.zero_topo import ZeroTopoOptions

STRATEGIES = [FabricEPSOStrategy, EPSOStrategy, FabricZeroTopoStrategy, ZeroTopoStrategy]
MISSPELLED = {FabricEPSOStrategy: "ep_szie", EPSOStrategy: "ep_szie", FabricZeroTopoStrategy: "weigth_size"}
MISSPELLED[ZeroTopoStrategy] = "weigth_size"
# a parallelism the strategy does not have (yet): epso has tensor and pipeline parallelism, not context parallelism
UNSUPPORTED = {FabricEPSOStrategy: "grad_size", EPSOStrategy: "grad_size", FabricZeroTopoStrategy: "tp_size"}
UNSUPPORTED[ZeroTopoStrategy] = "tp_size"


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("keyword", ["misspelled", "unsupported", "find_unused_parameters", "static_graph"])
def test_unknown_keywords_are_refused_and_named(cls, keyword):
    """A misspelled option, a sharding this strategy does not have (``grad_size``, zero_topo's, on epso, ``tp_size`` on
    zero_topo) and DDP-wrapper arguments that mean nothing without a wrapper all raise a TypeError naming the keyword
    and the arguments that do exist."""
    name = {"misspelled": MISSPELLED, "unsupported": UNSUPPORTED}.get(keyword, {cls: keyword})[cls]
    with pytest.raises(TypeError) as err:
        cls(**{name: 2})
    message = str(err.value)
    assert f"['{name}']" in message and cls.__name__ in message
    assert ("'ep_size'" if "EPSO" in cls.__name__ else "'weight_size'") in message
    assert "'process_group_backend'" in message


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_own_options_and_meaningful_ddp_arguments_are_taken(cls):
    """The strategy's own options land in its settings; the process-group backend and timeout reach Lightning."""
    own = {"ep_size": 2, "dispatcher": "alltoall"} if "EPSO" in cls.__name__ else {"weight_size": 2, "seed": 5}
    strategy = cls(**own, process_group_backend="gloo", timeout=timedelta(seconds=42))
    for key, value in own.items():
        assert getattr(strategy.settings, key) == value
    assert strategy._process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=42)


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_options_are_visible_to_the_cli_parser(cls):
    """jsonargparse (the engine of LightningCLI) sees every own option with its type: a value parses, a misspelled
    option is refused by the parser too."""
    options = EPSOOptions if "EPSO" in cls.__name__ else ZeroTopoOptions
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    first = "ep_size" if options is EPSOOptions else "weight_size"
    assert parser.parse_args([f"--strategy.{first}=4"]).strategy[first] == 4
    with pytest.raises(Exception, match=MISSPELLED[cls]):
        parser.parse_args([f"--strategy.{MISSPELLED[cls]}=4"])
    if options is EPSOOptions:  # the tensor-parallel options are typed too (what `mula fit --help` lists)
        parsed = parser.parse_args(
            ["--strategy.tp_size=2", "--strategy.etp_size=2", "--strategy.sequence_parallel=true"]
        )
        assert (parsed.strategy.tp_size, parsed.strategy.etp_size, parsed.strategy.sequence_parallel) == (2, 2, True)
        with pytest.raises(Exception, match="tp_size"):
            parser.parse_args(["--strategy.tp_size=two"])


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_the_declared_protocol(cls):
    """Every sharding strategy implements ShardingStrategy (meta build, seed, EP size, global grad norm); a plain
    DDP strategy does not, and counts as EP 1."""
    kwargs = {"ep_size": 4} if "EPSO" in cls.__name__ else {}
    strategy = cls(**kwargs)
    assert isinstance(strategy, ShardingStrategy) and strategy.builds_on_meta
    assert strategy_ep_size(strategy) == kwargs.get("ep_size", 1)
    strategy.init_seed = 123
    assert strategy.settings.seed == 123 == strategy.init_seed
    assert not isinstance(TrainerDDPStrategy(), ShardingStrategy) and strategy_ep_size(TrainerDDPStrategy()) == 1


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: c.__name__)
def test_every_overridden_lightning_hook_is_marked(cls):
    """Each method our classes define that exists on Lightning's DDP strategy carries ``@override`` (a renamed hook
    upstream then shows up in type checking instead of silently never being called)."""
    base = FabricDDPStrategy if cls.__name__.startswith("Fabric") else TrainerDDPStrategy
    ours = [c for c in cls.__mro__ if c.__module__.startswith("mula_lightning")]
    assert ShardedFabricHooks in ours or InPlaceCheckpointRestore in ours
    unmarked = []
    for klass in ours:
        for name, member in vars(klass).items():
            is_method = inspect.isfunction(member) or isinstance(member, (property, classmethod, staticmethod))
            if name.startswith("__") or not is_method or not hasattr(base, name):
                continue
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if not getattr(func, "__override__", False):
                unmarked.append(f"{klass.__name__}.{name}")
    assert not unmarked, unmarked


@pytest.mark.parametrize(
    "options,fragment",
    [
        (dict(tp_size=0), r"tp_size \(0\) must be an integer >= 1"),
        (dict(tp_size=True), r"tp_size \(True\) must be an integer >= 1"),
        (dict(sequence_parallel=True), r"sequence_parallel=True .* set tp_size > 1"),
        (dict(tp_size=2, sharded_optimizer="dp"), r"sharded_optimizer='dp' with tp_size \(2\) > 1 is not supported"),
        (dict(etp_size=0), r"etp_size \(0\) must be an integer >= 1"),
        (
            dict(etp_size=2, dispatcher="alltoall"),
            r"etp_size \(2\) > 1 needs dispatcher='allgather' \(got 'alltoall'\)",
        ),
        (dict(etp_size=2, sharded_optimizer="dp"), r"sharded_optimizer='dp' with etp_size \(2\) > 1 is not supported"),
    ],
)
def test_tensor_parallel_options_that_cannot_work_are_refused_at_construction(options, fragment):
    """A tensor-parallel degree below 1 (or a bool), sequence parallelism without tensor parallelism, the DP-only
    optimizer baseline with tensor or expert tensor parallelism, and expert tensor parallelism with the all-to-all
    dispatcher each raise one ValueError naming the value, before any process."""
    for cls in (FabricEPSOStrategy, EPSOStrategy):
        with pytest.raises(ValueError, match=fragment):
            cls(**options)


def test_a_sequence_sequence_parallelism_cannot_split_is_named():
    """Under sequence parallelism a batch whose sequence length tp does not divide is refused naming both."""
    from mula_lightning.parallel.tensor_parallel import _check_sequence_split

    _check_sequence_split(None, (torch.zeros(2, 12, dtype=torch.long),), tp=4)
    with pytest.raises(ValueError, match=r"tp_size \(4\) ranks: the sequence length \(13\) must be divisible"):
        _check_sequence_split(None, (torch.zeros(2, 13, dtype=torch.long),), tp=4)
