"""The epso strategy with pipeline parallelism (Fabric, ``strategy.pipeline_step``) against one process, in real
processes.

Layouts: PP=2 with each schedule (gpipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank) on 2 gloo ranks;
PP=2 x DP=2, PP=2 x EP=2, PP=2 x TP=2 (dense), PP=2 x (TP=2 + SP folded with EP=2) and PP=2 x (CP=2 folded with
EP=2) on 4 (stages are consecutive blocks of ranks; inside a stage, data, expert, tensor and context parallelism as
without pipelining). An MoE model of 4
layers with its load-balancing and z losses on (or a dense one), 4 micro-batches of one sequence per step, the
``ep_aware`` optimizer, 5 AdamW steps clipped by the global norm (small enough that
clipping fires on every step), float64. The reference is one process that runs each data-parallel batch's 4
micro-batches through the whole model, averages their losses (cross-entropy plus auxiliary losses) and the batches',
and steps torch's AdamW after torch's ``clip_grad_norm_``. Every rank's step loss (the pipeline's, on every rank of
it), the pre-clip global norms and every parameter a rank holds must match; each rank holds only its stages'.
"""

import pytest
import torch
from lightning.fabric import Fabric

from mula_lightning.models import MulaConfig, MulaForCausalLM, init_weights
from mula_lightning.optim.muon import MuonAdamW, muon_param_groups
from mula_lightning.strategies import FabricEPSOStrategy
from mula_lightning.testing import adamw_parameter_scale, assert_parity, run_pooled_test

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05
STEPS = 5
H, FF, V, T, E, M, L = 16, 16, 64, 8, 4, 4, 4  # hidden, intermediate, vocabulary, sequence, experts, micro, layers
# per layer, dots over H (q / k / v / o and the router), T (attention), 2 FF (experts), E (router softmax); the
# vocabulary's softmax; a weight gradient sums over every batch's tokens (2 batches x M x T)
GRAD_LEN = L * (5 * H + T + 2 * FF + E) + V + 2 * M * T
ADAM_SCALE = adamw_parameter_scale(lr=HP["lr"], grad_bound=MAX_NORM, eps=HP["eps"])


def _config(kind="moe"):
    if kind == "dense":
        return MulaConfig.from_name(
            "mula-tiny-dense", vocab_size=V, hidden_size=H, num_layers=L, num_heads=2, num_kv_heads=2,
            intermediate_size=FF,
        )  # fmt: skip
    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=V, hidden_size=H, num_layers=L, num_heads=2, num_kv_heads=2,
        intermediate_size=FF, num_experts=E, top_k=2, moe_impl="fast", z_loss_coef=1e-3,
    )  # fmt: skip


def _batch(step, dp_rank):
    return torch.randint(0, V, (M, T), generator=torch.Generator().manual_seed(1000 * step + dp_rank))


def _optimizer(model, optimizer="adamw"):
    """torch's AdamW on every parameter, or Muon on the layers' matrices with AdamW for the rest."""
    if optimizer == "muon":
        return MuonAdamW(muon_param_groups(model), **HP)
    return torch.optim.AdamW(model.parameters(), **HP)


def _setup(world_size, pp, ep, schedule="1f1b", virtual=1, tp=1, sp=False, kind="moe", boundaries=None,
           optimizer="adamw", cp=1):  # fmt: skip
    strategy = FabricEPSOStrategy(
        ep_size=ep, pp_size=pp, pp_schedule=schedule, pp_microbatches=M, pp_virtual_stages=virtual, bucket_numel=3000,
        tp_size=tp, sequence_parallel=sp, pp_boundaries=boundaries, cp_size=cp,
    )  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config(kind))
    # the optimizer of the whole meta model: setup keeps this rank's stages' parameters
    model, optimizer = fabric.setup(model, _optimizer(model, optimizer))
    return fabric, model, optimizer


def _steps(fabric, model, optimizer, steps):
    dp_rank = fabric.strategy.distributed_sampler_kwargs["rank"]
    losses, norms = [], []
    for step in steps:
        x = _batch(step, dp_rank)
        if fabric.strategy.pp_size > 1:
            result = fabric.strategy.pipeline_step(x, x)
        else:  # the same micro-batches through the whole model, accumulated
            for i in range(M):
                out = model(x[i : i + 1], labels=x[i : i + 1])
                with fabric.no_backward_sync(model, enabled=i < M - 1):
                    fabric.backward((out.loss + out.aux_loss) / M)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(result.loss.item() if fabric.strategy.pp_size > 1 else float("nan"))
    return losses, norms


def _local_state(model):
    """This rank's parameters: tensor-parallel ones gathered over tp (collective), expert slices as held."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.module.state_dict().items()
    }


def _train(rank, world_size, pp, ep, schedule, virtual=1, steps=STEPS, tp=1, sp=False, kind="moe", boundaries=None,
           optimizer="adamw", cp=1):  # fmt: skip
    fabric, model, optimizer = _setup(world_size, pp, ep, schedule, virtual, tp, sp, kind, boundaries, optimizer, cp)
    losses, norms = _steps(fabric, model, optimizer, range(steps))
    topo = fabric.strategy.topology
    state = _local_state(model)
    runner = fabric.strategy.pipeline
    fused = runner.last, runner.fused_loss, [m.hidden_out for _, m in runner.stages]
    return losses, norms, state, (topo.ep_rank, topo.ep_size), fabric.strategy.distributed_sampler_kwargs, fused


def _reference(dp, steps=STEPS, kind="moe", optimizer="adamw"):
    """One process; ``dp`` batches per step (a list: per step, for a run resumed at another layout)."""
    model = init_weights(MulaForCausalLM(_config(kind)), seed=0).to(torch.float64)
    opt = _optimizer(model, optimizer)
    losses, norms = [], []
    for step in range(steps):
        per_batch = []
        for b in range(dp[step] if isinstance(dp, list) else dp):
            x = _batch(step, b)
            outs = [model(x[i : i + 1], labels=x[i : i + 1]) for i in range(M)]
            per_batch.append(torch.stack([o.loss + o.aux_loss for o in outs]).mean())
        torch.stack(per_batch).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append([p.item() for p in per_batch])
    return losses, norms, model.state_dict()


def _compare(results, reference, stage_size, dp, tp=1):
    ref_losses, ref_norms, ref_state = reference
    seen = set()
    for rank, (losses, norms, state, (ep_rank, ep_size), sampler, *_) in enumerate(results):
        # expert-parallel peers read their own batch, tensor-parallel ones (and a pipeline's ranks) the same
        assert sampler == {"num_replicas": dp, "rank": rank % stage_size // tp}
        expected = torch.tensor([step[sampler["rank"]] for step in ref_losses], dtype=torch.float64)
        assert_parity(torch.tensor(losses, dtype=torch.float64), expected, reduction_len=GRAD_LEN, msg="losses")
        assert_parity(torch.tensor(norms), torch.tensor(ref_norms), reduction_len=STEPS * GRAD_LEN, msg="norms")
        assert len(state) < len(ref_state)  # a stage's parameters only
        for name, value in state.items():
            ref = ref_state[name]
            if ".experts." in name and ep_size > 1:
                per = ref.shape[0] // ep_size
                ref = ref[ep_rank * per : (ep_rank + 1) * per]
            scale = ADAM_SCALE + ref.abs().max().item()
            assert_parity(value, ref, reduction_len=STEPS * GRAD_LEN, scale=scale, msg=f"rank {rank} {name}")
            seen.add(name)
    assert seen == set(ref_state)  # the stages cover the model


LAYOUTS = {
    "pp2 gpipe": dict(world=2, pp=2, ep=1, schedule="gpipe"),
    "pp2 1f1b": dict(world=2, pp=2, ep=1, schedule="1f1b"),
    "pp2 1f1b, stages of 1 and 3 layers": dict(world=2, pp=2, ep=1, schedule="1f1b", boundaries=[1]),
    "pp2 interleaved 1f1b x2 virtual": dict(world=2, pp=2, ep=1, schedule="interleaved_1f1b", virtual=2),
    "pp2 x dp2 1f1b": dict(world=4, pp=2, ep=1, schedule="1f1b"),
    "pp2 x ep2 1f1b": dict(world=4, pp=2, ep=2, schedule="1f1b"),
    "pp2 x tp2 dense 1f1b": dict(world=4, pp=2, ep=1, schedule="1f1b", tp=2, kind="dense"),
    "pp2 x tp2+sp folded with ep2 1f1b": dict(world=4, pp=2, ep=2, schedule="1f1b", tp=2, sp=True),
    "pp2 x ep2 1f1b, Muon": dict(world=4, pp=2, ep=2, schedule="1f1b", optimizer="muon"),
    "pp2 x cp2 folded with ep2 1f1b": dict(world=4, pp=2, ep=2, schedule="1f1b", cp=2),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_parallel_epso_matches_one_process(layout):
    """5 clipped AdamW steps (Muon on the layers' matrices for the Muon layout, each owned whole by one rank of its
    stage) with the MoE losses on, float64: every rank's step loss, the pre-clip global norms and
    each parameter a rank holds equal one process; every rank of a pipeline reads the same batch and the stages
    cover the model. The last stage runs the LM head fused with the loss (the reference's plain head + loss), except
    under TP, whose vocabulary-parallel head keeps its loss over its logits. Under CP each rank's stages compute two
    chunks of the batch's sequences (the reference: the whole sequences)."""
    spec = dict(LAYOUTS[layout])
    world = spec.pop("world")
    results = run_pooled_test(_train, world, **spec, timeout=300)
    stage, tp = world // spec["pp"], spec.get("tp", 1)
    group = tp * spec.get("cp", 1)  # the ranks of a stage reading one batch
    reference = _reference(stage // group, kind=spec.get("kind", "moe"), optimizer=spec.get("optimizer", "adamw"))
    _compare(results, reference, stage, stage // group, group)
    for *_, (last, fused, hidden_out) in results:  # the LM head runs fused with the loss, except TP's vocab-parallel
        assert fused == (last and tp == 1)
        assert hidden_out == [fused and i == len(hidden_out) - 1 for i in range(len(hidden_out))]


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(pp_size=2, pp_schedule="zb1p"), r"pp_schedule \('zb1p'\) must be one of \('gpipe', '1f1b'"),
        (dict(pp_size=2, pp_virtual_stages=2), r"pp_virtual_stages \(2\) > 1 needs pp_schedule='interleaved_1f1b'"),
        (dict(pp_size=4, pp_microbatches=2), r"pp_microbatches \(2\) must be at least pp_size \(4\) for 1f1b"),
        (dict(pp_size=2, pp_microbatches=0), r"pp_microbatches \(0\) must be an integer >= 1"),
        (dict(pp_size=0), r"pp_size \(0\) must be an integer >= 1"),
    ],
)
def test_pipeline_options_that_cannot_work_are_named(kwargs, fragment):
    """Unknown schedules, virtual stages on a one-stage schedule, too few micro-batches for 1F1B and sizes below 1
    raise at construction, naming the values."""
    with pytest.raises(ValueError, match=fragment):
        FabricEPSOStrategy(**kwargs)


def test_stages_balanced_by_parameter_count():
    """``pp_boundaries="params"``: contiguous stages whose largest parameter count is the smallest possible, the
    embedding counted on the first stage and the LM head on the last: a vocabulary as large as two layers pushes
    layers off the end stages; the model keeps the cuts for the stage split."""
    from mula_lightning.parallel.pipeline import balanced_boundaries, prune_to_stages, split_into_stages

    def meta(vocab, layers=8):
        with torch.device("meta"):
            return MulaForCausalLM(MulaConfig.from_name("mula-tiny-dense", vocab_size=vocab, num_layers=layers))

    assert balanced_boundaries(meta(8), 4) == [2, 4, 6]  # a tiny vocabulary: equal layer counts
    model = meta(16384)  # embedding and LM head of 2.1M parameters each, a layer of 0.26M: the end stages hold
    cuts = balanced_boundaries(model, 4)  # one layer each, the middle ones split the other six evenly
    assert cuts == [1, 4, 7]
    with pytest.raises(ValueError, match="4 pipeline stages need at least as many layers; the model has 2"):
        balanced_boundaries(meta(8, layers=2), 4)
    pruned = meta(16384)
    prune_to_stages(pruned, 1, 4, boundaries="params")
    assert pruned.pipeline_boundaries == cuts
    assert [i for i, _ in split_into_stages(pruned, 1, 4)] == [1]
    assert split_into_stages(pruned, 1, 4)[0][1].layer_ids == list(range(cuts[0], cuts[1]))
    with pytest.raises(ValueError, match=r"pp_boundaries \('even'\) must be a list of layer indices, 'params'"):
        FabricEPSOStrategy(pp_size=2, pp_boundaries="even")


def test_pipeline_step_without_pipeline_parallelism_is_refused():
    """``pipeline_step`` on a strategy without pipeline stages says why instead of running a plain forward."""
    with pytest.raises(RuntimeError, match=r"pipeline_step is for pipeline parallelism; .* pp_size 1"):
        FabricEPSOStrategy(ep_size=1).pipeline_step(torch.zeros(1, 4, dtype=torch.long))


def test_a_pruned_model_keeps_its_names_and_refuses_a_whole_forward():
    """Pruning to stage 1 of 2 keeps the single-device names of the last two layers, the final norm and the LM head,
    drops the embedding, and the pruned model's own forward names the stage instead of failing inside."""
    from mula_lightning.parallel.pipeline import prune_to_stages

    with torch.device("meta"):
        model = MulaForCausalLM(_config())
    assert prune_to_stages(model, 1, 2) == [2, 3]
    names = {n.split(".")[0] + "." + n.split(".")[1] for n in dict(model.named_parameters())}
    assert names == {"model.layers", "model.norm", "lm_head.weight"}
    assert {int(n.split(".")[2]) for n in dict(model.named_parameters()) if ".layers." in n} == {2, 3}
    with pytest.raises(RuntimeError, match=r"holds pipeline stages \[1\] of the model \(layers \[2, 3\]\)"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="ties them"):
        with torch.device("meta"):
            tied = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe", tie_word_embeddings=True))
        prune_to_stages(tied, 0, 2)


def _whole(states):
    """The model's weights from every rank's ``(state, (ep_rank, ep_size))``: expert slices put in place."""
    out = {}
    for state, (ep_rank, ep_size) in states:
        for name, value in state.items():
            if ".experts." in name and ep_size > 1:
                full = out.setdefault(
                    name, torch.zeros((value.shape[0] * ep_size, *value.shape[1:]), dtype=value.dtype)
                )
                full[ep_rank * value.shape[0] : (ep_rank + 1) * value.shape[0]] = value
            else:
                out[name] = value
    return out


def _save_at(rank, world_size, path, pp, ep, steps):
    fabric, model, optimizer = _setup(world_size, pp, ep)
    _steps(fabric, model, optimizer, range(steps))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})
    topo = fabric.strategy.topology
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, (topo.ep_rank, topo.ep_size)


def _resume_at(rank, world_size, path, pp, ep, steps):
    """Load the checkpoint at this layout, train ``steps`` more steps; the loaded weights and the norms."""
    fabric, model, optimizer = _setup(world_size, pp, ep)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    topo = fabric.strategy.topology
    loaded = {k: v.detach().clone() for k, v in model.module.state_dict().items()}, (topo.ep_rank, topo.ep_size)
    _, norms = _steps(fabric, model, optimizer, range(state["step"], state["step"] + steps))
    return state["step"], loaded, norms


@pytest.mark.distributed
def test_checkpoint_saved_at_pp2_ep2_resumes_at_pp1_ep4_and_loads_in_one_process(tmp_path):
    """Saved after 2 steps at PP=2 x EP=2 (each stage writes its layers, logical keys): loaded at PP=1 x EP=4 every
    weight is the saved one and 2 more steps there give the global norms of an uninterrupted PP=2 x EP=2 run (the
    AdamW moments and step travelled too: the 2 steps after the resume, which read 4 batches where PP=2 x EP=2 read
    2, give the global norms of one process that does the same); loaded into one process, the weights are the saved
    ones."""
    from mula_lightning.checkpoint.sharded import load_sharded_checkpoint
    from mula_lightning.parallel.sharded_optimizer import ShardedAdamW
    from mula_lightning.parallel.topology import build_topology

    path = str(tmp_path / "pp2ep2")
    saved = _whole(run_pooled_test(_save_at, 4, path=path, pp=2, ep=2, steps=2, timeout=300))
    resumed = run_pooled_test(_resume_at, 4, path=path, pp=1, ep=4, steps=2, timeout=300)
    assert [r[0] for r in resumed] == [2] * 4  # the saved step
    loaded = _whole([r[1] for r in resumed])
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    ref_norms = _reference([2, 2, 4, 4], steps=4)[1]
    for _, _, norms in resumed:
        assert_parity(torch.tensor(norms), torch.tensor(ref_norms[2:]), reduction_len=4 * GRAD_LEN, msg="norms")

    model = MulaForCausalLM(_config()).to(torch.float64)
    topology = build_topology(1)
    optimizer = ShardedAdamW(model, topology, "ep_aware", **HP)
    load_sharded_checkpoint(tmp_path / "pp2ep2", {"model": model, "optimizer": optimizer}, topology)
    assert optimizer._step == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_a_module_without_one_mula_model_is_refused_before_any_group():
    """Pipeline parallelism of a module that holds no MulaForCausalLM (or two): the module is named, before the
    strategy builds a process group."""
    from mula_lightning.strategies.epso import EPSOSettings, setup_epso_module

    with pytest.raises(ValueError, match=r"pp_size \(2\) > 1 splits one MulaForCausalLM by layers; Linear holds 0"):
        setup_epso_module(torch.nn.Linear(2, 2), EPSOSettings(pp_size=2), torch.device("cpu"))
    two = torch.nn.ModuleList([MulaForCausalLM(_config()), MulaForCausalLM(_config())])
    with pytest.raises(ValueError, match="ModuleList holds 2"):
        setup_epso_module(two, EPSOSettings(pp_size=2), torch.device("cpu"))


def _init_from_rank(rank, world_size, path):
    strategy = FabricEPSOStrategy(ep_size=2, pp_size=2)
    strategy.init_from = path
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MulaForCausalLM(_config())
    model = fabric.setup_module(model)
    topo = fabric.strategy.topology
    return _local_state(model), (topo.ep_rank, topo.ep_size)


@pytest.mark.distributed
def test_init_from_reads_each_stage_its_own_weights(tmp_path):
    """``init_from`` a transformers directory at PP=2 x EP=2: every rank starts from the source's values of exactly
    its stage's tensors (its expert slice of them), and the stages cover the model."""
    from mula_lightning.models.hf_convert import save_hf

    source = init_weights(MulaForCausalLM(_config()), seed=7).to(torch.float64)
    save_hf(source, tmp_path / "hf")
    states = run_pooled_test(_init_from_rank, 4, path=str(tmp_path / "hf"), timeout=300)
    assert all(len(state) < len(source.state_dict()) for state, _ in states)
    whole = _whole(states)
    assert whole.keys() == source.state_dict().keys()
    for name, value in source.state_dict().items():
        torch.testing.assert_close(whole[name], value, rtol=0, atol=0, msg=name)


def _masked(x):
    """Labels of a batch with masked targets: micro-batch 0 wholly masked (a prompt-only sample), micro-batch 1 with
    its last 3 labels only, the others whole."""
    labels = x.clone()
    labels[0] = -100
    labels[1, : T - 3] = -100
    return labels


def _train_masked(rank, world_size, pp, tp, kind):
    fabric, model, optimizer = _setup(world_size, pp, 1, "1f1b", tp=tp, kind=kind)
    dp_rank = fabric.strategy.distributed_sampler_kwargs["rank"]
    losses = []
    for step in range(STEPS):
        x = _batch(step, dp_rank)
        losses.append(fabric.strategy.pipeline_step(x, _masked(x)).loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses, _local_state(model)


def _reference_masked(kind):
    """One process: the batch's cross-entropy averaged over its real tokens (each micro-batch's mean weighted by its
    real tokens; 0 for the masked one), the auxiliary losses averaged over the micro-batches."""
    model = init_weights(MulaForCausalLM(_config(kind)), seed=0).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses = []
    for step in range(STEPS):
        x = _batch(step, 0)
        labels = _masked(x)
        real = [int((labels[i, 1:] != -100).sum()) for i in range(M)]
        outs = [model(x[i : i + 1], labels=labels[i : i + 1]) for i in range(M)]
        lm = sum(o.loss * n for o, n in zip(outs, real)) / sum(real)
        loss = lm + torch.stack([o.aux_loss for o in outs]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("kind,tp", [("moe", 1), ("dense", 2)], ids=["pp2 fused loss", "pp2 x tp2 vocab-parallel"])
def test_pipelined_step_on_masked_labels_matches_one_process(kind, tp):
    """A batch whose first micro-batch is wholly masked (-100) and whose second has 3 real labels: the pipelined step
    (PP=2 with the last stage's fused head + loss; PP=2 x TP=2 with the vocabulary-parallel loss) weights each
    micro-batch by its real tokens, as one forward of the batch does, and stays finite: losses and every parameter
    after 5 clipped AdamW steps equal one process in float64. Before, the masked micro-batch's mean was 0/0 and
    every gradient of the model NaN, and a 3-token micro-batch weighed as much as a whole one."""
    results = run_pooled_test(_train_masked, 2 * tp, pp=2, tp=tp, kind=kind, timeout=300)
    ref_losses, ref_state = _reference_masked(kind)
    for rank, (losses, state) in enumerate(results):
        assert_parity(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64),
                      reduction_len=GRAD_LEN, msg=f"rank {rank} losses")  # fmt: skip
        for name, value in state.items():
            scale = ADAM_SCALE + ref_state[name].abs().max().item()
            assert_parity(
                value, ref_state[name], reduction_len=STEPS * GRAD_LEN, scale=scale, msg=f"rank {rank} {name}"
            )


def _odd_sequence_under_sp(rank, world_size):
    fabric, _, _ = _setup(world_size, 2, 2, "1f1b", tp=2, sp=True)
    x = torch.randint(0, V, (M, T - 1), generator=torch.Generator().manual_seed(rank))
    try:
        fabric.strategy.pipeline_step(x, x)
    except ValueError as err:
        return str(err)
    return "nothing raised"


@pytest.mark.distributed
def test_sequence_parallelism_under_pipeline_parallelism_checks_the_sequence_length():
    """PP=2 x (TP=2 + SP folded with EP=2): a batch of 7-token sequences, which sequence parallelism cannot split over
    2 ranks, is refused on every rank with the error naming both values before the schedule runs. Before, the check
    hooked the decoder's forward, which pipeline stages bypass: nothing was said."""
    for message in run_pooled_test(_odd_sequence_under_sp, 4, timeout=120):
        assert "tp_size (2) ranks: the sequence length (7) must be divisible by it" in message, message
