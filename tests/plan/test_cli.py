"""``mula plan`` on the command line: the paper's layouts planned on Aurora (table and JSON keys), a mula fit YAML read
for its layout, a machine from a YAML file, and bad input in one line."""

import json

from mula_lightning.cli import main as mula
from mula_lightning.plan.clusters import GB


def _json(capsys, *args):
    assert mula(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_220b_recipe_on_1024_aurora_nodes(capsys):
    """PP 8 x EP 12 x DP 128 (12,288 tiles, the paper's largest run): the JSON has the stable keys, the model's
    220 B / 10 B parameters, one row per stage, the last (head and final norm) the worst, the first (embedding) next,
    and the states fit 64 GB."""
    result = _json(capsys, "mula-220b-a10b", "--cluster", "aurora", "--nodes", "1024", "--ep", "12", "--pp", "8")
    assert round(result["model"]["total_params"] / 1e9) == 220 and round(result["model"]["active_params"] / 1e9) == 10
    (layout,) = result["layouts"]
    assert (layout["dp"], layout["ep"], layout["pp"], layout["strategy"], layout["fits"]) == (128, 12, 8, "epso", True)
    assert set(layout["memory_bytes"]) == {"weights", "gradients", "master", "moments", "activations", "buffers",
                                           "total"}  # fmt: skip
    assert len(layout["stages"]) == 8 and layout["memory_bytes"] == layout["stages"][layout["worst_stage"]]
    first, second, last = layout["stages"][0], layout["stages"][1], layout["stages"][-1]
    assert last["weights"] > first["weights"] > second["weights"]  # the head and final norm / the embedding
    assert [a["in_flight"] for a in layout["activations"]] == [8, 7, 6, 5, 4, 3, 2, 1]  # 1F1B, 8 micro-batches
    assert first["activations"] > second["activations"] and layout["worst_stage"] == 0
    assert set(layout["comm_bytes"]) == {"intra_node", "inter_node"}  # EP in the node, DP and PP across nodes
    assert mula(["plan", "mula-220b-a10b", "--nodes", "1024", "--ep", "12", "--pp", "8"]) == 0
    out = capsys.readouterr().out
    assert "DP 128 x EP 12 x PP 8" in out and "moe.dispatch.x" in out and "(point-to-point: not in the ledger)" in out


def test_a_fit_config_is_read_and_what_does_not_fit_is_said(capsys):
    """``--config`` takes the 100B recipe's PP 4 x EP 12 on its 256 nodes; replicated 220B states on one 8 x H100
    node do not fit, and the reason names both sizes."""
    (layout,) = _json(capsys, "--config", "examples/configs/mula-100b-a7b.yaml")["layouts"]
    assert (layout["dp"], layout["ep"], layout["pp"], layout["precision"]) == (64, 12, 4, "bf16-true")
    assert (layout["micro_batches"], layout["sequences_per_micro_batch"], layout["seq_len"]) == (4, 1, 2048)
    assert layout["activation_checkpointing"] == ["moe"] and layout["fits"]
    reduce = [c for c in layout["collectives"] if c["tag"] == "optimizer.expert" and c["op"] == "reduce_scatter"]
    (plain,) = [c for c in _json(capsys, "--config", "examples/configs/mula-100b-a7b.yaml", "--reduce-dtype",
                                 "float32")["layouts"][0]["collectives"] if c["tag"] == reduce[0]["tag"]
                and c["op"] == "reduce_scatter"]  # fmt: skip
    assert plain["bytes_sent"] == 2 * reduce[0]["bytes_sent"]  # the recipe reduces in bf16; the flag overrides
    result = _json(capsys, "mula-220b-a10b", "--cluster", "dgx-h100", "--ep", "8", "--mode", "none")
    (layout,) = result["layouts"]
    assert not layout["fits"] and "the device has 76.0 GB (80 GB less 4 GB reserved)" in layout["reason"]
    assert layout["memory_bytes"]["total"] > 76 * GB


def test_a_cluster_file_and_bad_input(tmp_path, capsys):
    """A cluster from YAML (4 devices of 24 GB, 2.5 reserved); an unknown preset, a file with a misspelt field, a
    layout that does not divide, zero nodes, EP on a dense model, a DP that is not what is left, an unknown recomputed
    part, sequence parallelism, a missing config: exit code 1 and one line naming the values."""
    (tmp_path / "lab.yaml").write_text("devices_per_node: 4\nmemory_gb: 24\nreserved_gb: 2.5\npeak_tflops: 300\n"
                                       "bandwidth_gbps: {intra_node: 100, inter_node: 25}\n")  # fmt: skip
    result = _json(capsys, "mula-1b", "--cluster", str(tmp_path / "lab.yaml"), "--nodes", "2")
    assert result["cluster"] == {"name": "lab", "nodes": 2, "devices_per_node": 4, "memory_bytes": 24 * GB,
                                 "reserved_bytes": 2.5 * GB}  # fmt: skip
    (tmp_path / "bad.yaml").write_text("devices_per_node: 4\nmemory: 24\n")
    (tmp_path / "links.yaml").write_text("devices_per_node: 4\nmemory_gb: 24\nbandwidth_gbps: {nvlink: 400}\n")
    (tmp_path / "gcds.yaml").write_text("devices_per_node: 4\nmemory_gb: 24\ndevices_per_gpu: 2\n"
                                        "bandwidth_gbps: {intra_node: 50, inter_node: 10}\n")  # fmt: skip
    for args, message in [
        (["mula-1b", "--cluster", "summit"], "unknown cluster 'summit'"),
        (["mula-1b", "--cluster", str(tmp_path / "bad.yaml")], "unknown fields ['memory'] / missing fields"),
        (["mula-1b", "--cluster", str(tmp_path / "links.yaml")], "bandwidth_gbps must map gcd / intra_node"),
        (["mula-1b", "--cluster", str(tmp_path / "gcds.yaml")], "no bandwidth for the link levels ['gcd']"),
        (["mula-7b-a1b", "--ep", "5"], "pp (1) x ep (5) must divide the world size (12)"),
        ([], "needs a preset"),
        (["mula-1b", "--nodes", "0"], "--nodes (0) must be at least 1"),
        (["mula-1b", "--ep", "2"], "ep (2) > 1 needs an MoE model; mula-1b is dense"),
        (["mula-7b-a1b", "--ep", "4", "--dp", "4"], "--dp (4) must be the world size / (pp x ep x etp) = 12"),
        (["mula-7b-a1b", "--activation-checkpointing", "moe,ffn"], "'ffn'"),
        (["mula-1b", "--sp", "2"], "--sp (2) must be 1 (off) or the tensor-parallel degree --tp (1)"),
        (["mula-1b", "--tp", "3"], "tp_size (3) must divide num_heads (16), num_kv_heads (16), intermediate_size"),
        (["mula-1b", "--tp", "5"], "pp (1) x tp (5) must divide the world size (12)"),
        (["mula-7b-a1b", "--tp", "2", "--sp", "2", "--seq-len", "2049"], "the sequence length (2049) must be"),
        (["mula-7b-a1b", "--etp", "2", "--dispatcher", "alltoall"], "etp (2) > 1 needs the all-gather dispatcher"),
        (["--config", "missing.yaml"], "--config missing.yaml: no such file"),
    ]:
        assert mula(["plan", *args]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_the_shipped_recipes_fit_aurora_at_their_node_counts(capsys):
    """The 20B, 100B and 220B recipes planned from their YAMLs on Aurora (256 nodes each, the papers' layouts):
    every stage fits 64 GB less the reserve, and the expert dispatch stays inside a node."""
    for name in ("mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"):
        result = _json(capsys, "--config", f"examples/configs/{name}.yaml")
        (layout,) = result["layouts"]
        assert result["cluster"]["nodes"] == 256 and layout["ep"] == 12 and layout["fits"], (name, layout["reason"])
        assert {c["link"] for c in layout["collectives"] if c["tag"].startswith("moe.")} == {"intra_node"}


def test_plot_draws_the_stages_and_names_a_bad_file(tmp_path, capsys):
    """--plot FILE.png writes a PNG of the stages' stacked memory (its path in the JSON); a file that is no image
    format is refused in one line."""
    figure = tmp_path / "plots" / "220b.png"
    result = _json(capsys, "mula-220b-a10b", "--nodes", "256", "--ep", "12", "--pp", "8", "--plot", str(figure))
    assert result["plot"] == str(figure) and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mula(["plan", "mula-1b", "--plot", str(tmp_path / "memory.txt")]) == 1
    assert "the figure is written as .png, .pdf or .svg" in capsys.readouterr().err


def test_a_fit_config_starting_from_existing_weights(tmp_path, capsys):
    """A mula fit YAML whose model comes from ``model.init_from`` (here a transformers OLMoE directory, config only:
    no tensor is read) plans that model; a missing directory is named in one line."""
    import transformers

    hf = transformers.OlmoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
    )
    hf.save_pretrained(tmp_path / "olmoe")
    fit = tmp_path / "fit.yaml"
    fit.write_text(f"model:\n  init_from: {tmp_path / 'olmoe'}\ntrainer:\n  devices: 12\n  precision: 32-true\n")
    result = _json(capsys, "--config", str(fit))
    (layout,) = result["layouts"]
    assert result["model"]["total_params"] > 0 and layout["precision"] == "32-true" and layout["fits"]
    fit.write_text(f"model:\n  init_from: {tmp_path / 'missing'}\n")
    assert mula(["plan", "--config", str(fit)]) == 1
    err = capsys.readouterr().err
    assert "model.init_from" in err and "gives no model config" in err and len(err.strip().splitlines()) == 1


def test_part_of_a_node_one_gpu_included(capsys):
    """``--devices-per-node 1``: one GPU of a DGX (a world of 1, DP 1) and one tile of an Aurora GPU (a GPU of one
    device); 4 of 8 GPUs at DP 4; more devices than a node holds is named."""
    result = _json(capsys, "mula-1b", "--cluster", "dgx-h100", "--nodes", "1", "--dp", "1", "--devices-per-node", "1")
    (layout,) = result["layouts"]
    assert (layout["dp"], result["cluster"]["devices_per_node"]) == (1, 1)
    assert result["cluster"]["name"] == "dgx-h100 (1 of 8 devices)"
    assert set(layout["comm_bytes"]) <= {"intra_node"}  # nothing leaves the one device's node
    (tile,) = _json(capsys, "mula-1b", "--cluster", "aurora", "--devices-per-node", "1")["layouts"]
    assert tile["dp"] == 1
    (half,) = _json(capsys, "mula-1b", "--cluster", "dgx-h100", "--devices-per-node", "4")["layouts"]
    assert half["dp"] == 4
    assert mula(["plan", "mula-1b", "--cluster", "dgx-h100", "--devices-per-node", "9"]) == 1
    assert "--devices-per-node (9) must be between 1 and dgx-h100's 8" in capsys.readouterr().err


def test_a_fit_config_is_planned_at_the_global_batch_mula_fit_runs(capsys, tmp_path):
    """The 7B recipe on 4 Aurora nodes: its ``data.global_batch_size`` 3072 over 48 ranks of one sequence is 64
    accumulated micro-batches per step, as ``mula fit`` runs it (planned before: one, a 48-sequence step and a
    tenth of the MFU); ``--accumulate`` still wins, and a global batch the ranks do not divide is one line."""
    config = "examples/configs/mula-7b-a1b.yaml"
    (layout,) = _json(capsys, "--config", config, "--nodes", "4")["layouts"]
    (single,) = _json(capsys, "--config", config, "--nodes", "4", "--accumulate", "1")["layouts"]
    assert layout["micro_batches"] == 64 and layout["micro_batch_size"] * 48 * 64 == 3072
    assert single["micro_batches"] == 1 and layout["mfu"] > 5 * single["mfu"]
    assert mula(["plan", "--config", config, "--nodes", "5"]) == 1  # 60 ranks: 3072 / 60 is not whole
    err = capsys.readouterr().err.strip()
    assert "global batch (3072" in err and "data-parallel batches (60)" in err and len(err.splitlines()) == 1, err


def test_the_search_table_sizes_multiply_to_the_world(capsys):
    """Each row's ``DP x CP x TP x PP`` is the world size (32 on 4 Frontier nodes), with the experts' EP beside it (was
    ``DP x EP x PP x TP`` with DP the replicas of an expert slice: 4 x 8 x 1 x 8 on 32 ranks); at 32K tokens context
    parallel layouts are among the rows."""
    cps = set()
    for seq_len in ("2048", "32768"):
        assert mula(["plan", "mula-7b-a1b", "--cluster", "frontier", "--nodes", "4", "--search", "--seq-len",
                     seq_len]) == 0  # fmt: skip
        out = capsys.readouterr().out.splitlines()
        header = next(i for i, line in enumerate(out) if "DP x CP x TP x PP" in line)
        rows = [line for line in out[header + 1 :] if line[:3].strip().isdigit()]
        assert len(rows) == 10
        for row in rows:
            dp, cp, tp, pp = (int(x) for x in row[22:43].replace("SP", "").split(" x "))
            assert dp * cp * tp * pp == 32, row
            cps.add((seq_len, cp))
    assert {cp for seq_len, cp in cps if seq_len == "2048"} == {1} and max(cp for _, cp in cps) > 1


def test_context_parallelism_from_the_flag_and_the_config(capsys):
    """``--config mula-tiny-moe-long.yaml`` plans its CP 4 x EP 2 on the config's 4 devices (``cp_size`` read): the
    keys and values exchanged over the 4 ranks at every attention, one batch for the 4; ``--cp`` overrides it; a
    length that does not split into 2 x cp chunks, or CP beside expert tensor parallelism: exit 1 and one line naming
    them."""
    long = "examples/configs/mula-tiny-moe-long.yaml"
    (layout,) = _json(capsys, "--config", long, "--devices-per-node", "4")["layouts"]
    assert (layout["cp"], layout["ep"], layout["dense_dp"], layout["seq_len"]) == (4, 2, 4, 8192)
    kv = {c["op"]: c for c in layout["collectives"] if c["tag"] == "cp.kv"}
    assert kv["all_gather"]["group_size"] == 4 and kv["reduce_scatter"]["calls"] == kv["all_gather"]["calls"] > 0
    assert layout["time"]["tokens_per_step"] == 8192
    (halved,) = _json(capsys, "--config", long, "--devices-per-node", "4", "--cp", "2")["layouts"]
    assert halved["cp"] == 2 and halved["time"]["tokens_per_step"] == 2 * 8192
    assert halved["memory_bytes"]["activations"] > layout["memory_bytes"]["activations"]
    refused = (
        (["--seq-len", "8196"], "sequence length 8196"),
        (["--cp", "2", "--etp", "2"], "cp (2) > 1 with etp (2)"),
    )
    for args, named in refused:
        assert mula(["plan", "--config", long, "--devices-per-node", "4", *args]) == 1
        err = capsys.readouterr().err.strip()
        assert named in err and len(err.splitlines()) == 1, err
    assert mula(["plan", "--config", long, "--devices-per-node", "4"]) == 0
    assert "(dense layers: DP 1 x CP 4 x TP 1)" in capsys.readouterr().out
