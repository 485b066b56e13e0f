"""``python -m lab cluster fit LOG... --model nccl``: NCCL's cost model fitted to ALCF Polaris' 2- and
8-node logs and predicted at 256 and 540 nodes, as text, as strict JSON and as NCCL's example tuner
file; the topology given on the command line, each bad value one line naming its option (exit 2).
Each command runs in this process (``lab.__main__.main``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import refusal

from lab.__main__ import main
from lab.sim.nccl import tuner_file

pytestmark = pytest.mark.no_ranks

POLARIS = Path(__file__).parent / "data" / "clusters" / "polaris-nccl-2.21"
LOGS = [str(POLARIS / "n2_all_reduce.log"), str(POLARIS / "n8_all_reduce.log")]
AS_BUILT = [
    "--model", "nccl", "--nic-gbit", "200", "--nics-per-node", "2", "--nic-path", "phb", "--cpu", "amd",
    "--fabric", "dragonfly:256:1.0625:0.7"]


def test_polaris_fitted_and_predicted_at_256_and_540_nodes(capsys, tmp_path):
    conf = tmp_path / "nccl_tuner.conf"
    assert main([
        "cluster", "fit", *LOGS, *AS_BUILT, "--predict-hosts", "256", "540", "--tuner-file",
        str(conf)]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs a node" in out and "2 NICs of 200 Gbit/s at phb" in out and "Dragonfly(" in out
    assert "n2_all_reduce.log 4 B-64 KiB" in out  # which log fixed a term
    assert "given" in out and "NCCL default" in out
    for nodes, ranks in ((256, 1024), (540, 2160)):
        assert f"Predicted allreduce at {nodes} nodes ({ranks} ranks):" in out
    last = out.split("Predicted allreduce at 540 nodes")[1].splitlines()
    row = last[-3].split()  # nccl-tests' columns, then what NCCL runs
    size, time_us, (algorithm, protocol, channels) = row[0], row[5], row[-3:]
    assert int(size) == 1 << 30 and float(time_us) > 0 and protocol in ("ll", "ll128", "simple")
    assert algorithm in ("ring", "tree") and int(channels) > 0
    rules = tuner_file.read(conf)
    assert {rule.nodes for rule in rules} == {256, 540}
    assert {rule.collective for rule in rules} == {"allreduce"}


def test_polaris_json_is_strict_and_names_each_terms_source(capsys):
    assert main(["cluster", "fit", *LOGS, *AS_BUILT, "--predict-hosts", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert out["topology"]["gpus_per_node"] == 4 and out["fabric"] == "Dragonfly"
    assert {term["source"] for term in out["terms"]} >= {"fitted", "NCCL default", "given"}
    (table,) = [p["table"] for p in out["predictions"] if p["hosts"] == 16]
    assert [row["bytes"] for row in table][-1] == 1 << 30
    assert all(row["protocol"] in ("ll", "ll128", "simple") and row["time_us"] > 0 for row in table)


def test_gpus_per_node_from_the_logs_and_fat_tree(capsys):
    assert main([
        "cluster", "fit", *LOGS, "--model", "nccl", "--nic-gbit", "200", "--fabric", "fat-tree:16:2",
        "--predict-hosts", "64"]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs a node" in out and "4 NICs of 200 Gbit/s" in out and "FatTree(nodes_per_leaf=16" in out


@pytest.mark.parametrize("options, message", [
    (["--nic-gbit", "0"], "argument --nic-gbit: nic_gbit must be a finite number > 0; got 0.0"),
    (["--nic-gbit", "nan"], "argument --nic-gbit: nic_gbit must be a finite number > 0"),
    (["--nic-gbit", "-200"], "argument --nic-gbit: nic_gbit must be"),
    (["--nic-gbit", "inf"], "argument --nic-gbit: nic_gbit must be a finite number > 0; got inf"),
    (["--nic-gbit", "200", "--nics-per-node", "nan"], "argument --nics-per-node: must be a whole number"),
    (["--nic-gbit", "200", "--predict-hosts", "0"], "argument --predict-hosts: must be a whole number"),
    (["--nic-gbit", "200", "--predict-hosts", "-540"], "argument --predict-hosts: must be a whole number"),
    (["--nic-gbit", "200", "--nics-per-node", "0"], "argument --nics-per-node: must be a whole number"),
    (["--nic-gbit", "200", "--gpus-per-node", "-4"], "argument --gpus-per-node: must be a whole number"),
    (["--nic-gbit", "200", "--gpus-per-node", "3"], "n2_all_reduce.log's ranks=8 is not a whole number"),
    (["--nic-gbit", "200", "--nic-path", "far"], "argument --nic-path: invalid choice: 'far'"),
    (["--nic-gbit", "200", "--fabric", "torus:4"], "argument --fabric: must be fat-tree:"),
    (["--nic-gbit", "200", "--fabric", "fat-tree:0:2"], "argument --fabric: nodes_per_leaf must be an int"),
    (["--nic-gbit", "200", "--fabric", "fat-tree:8:0.5"], "argument --fabric: oversubscription must be >= 1"),
    (["--nic-gbit", "200", "--fabric", "dragonfly:64:nan"], "argument --fabric: global_link_share must be"),
    (["--nic-gbit", "200", "--fabric", "dragonfly:64:x"], "argument --fabric: global_link_share must be a"),
    (["--nic-gbit", "200", "--fabric", "dragonfly:64:1:-1"], "argument --fabric: global_hop_us must be"),
    ([], "argument --nic-gbit: required with --model nccl"),
    (["--nic-gbit", "200", "--tuner-file", "/tmp", "--predict-hosts", "4"
      ], "argument --tuner-file: /tmp is a directory"),
    (["--nic-gbit", "200", "--tuner-file", "/nonexistent/x.conf", "--predict-hosts", "4"
      ], "argument --tuner-file: the folder of /nonexistent/x.conf does not exist"),
    (["--nic-gbit", "200", "--tuner-file", "x.conf"], "argument --tuner-file: needs the node counts of")])
def test_bad_topology_names_the_option(capsys, options, message):
    assert message in refusal(capsys, ["cluster", "fit", *LOGS, "--model", "nccl", *options])


def test_nccl_2_18_logs_fitted_with_its_tuner(capsys):
    old = Path(__file__).parent / "data" / "clusters" / "polaris-nccl-2.18"
    assert main([
        "cluster", "fit",
        str(old / "n2_all_gather.log"),
        str(old / "n8_all_gather.log"), *AS_BUILT, "--nccl-version", "2.18", "--predict-hosts", "128",
        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (table,) = [p["table"] for p in out["predictions"] if p["hosts"] == 128]
    assert all(row["algorithm"] == "ring" for row in table)
    line = refusal(capsys, ["cluster", "fit", *LOGS, *AS_BUILT, "--nccl-version", "2.19"])
    assert "argument --nccl-version: invalid choice: '2.19'" in line


def test_nccl_options_refused_with_the_simulator(capsys):
    line = refusal(capsys, ["cluster", "fit", *LOGS, "--nic-gbit", "200"])
    assert "argument --nic-gbit: only with --model nccl" in line


def test_a_one_node_log_named(capsys, tmp_path):
    one_node = tmp_path / "n1.log"
    text = (POLARIS / "n2_all_reduce.log").read_text()
    one_node.write_text(text.replace("x3006c0s19b0n0", "x3006c0s13b1n0"))
    line = refusal(
        capsys,
        ["cluster", "fit",
         str(one_node), "--model", "nccl", "--nic-gbit", "200", "--gpus-per-node", "8"])
    assert "n1.log: one node; the fit needs logs across nodes" in line
