"""The multi-node shape on one machine: examples/python/fsdp2_train.py launched by torchrun as two nodes of two
processes (two torchrun agents, node ranks 0 and 1, c10d rendezvous on 127.0.0.1; Gloo, one thread per rank): HSDP on
a 2 x 2 mesh, replicated across the nodes and sharded within each. The launch trains STEPS steps with an Inf written
into one gradient on one rank of node INF_NODE at step INF_AT and saves a distributed checkpoint after SAVED_AT
steps; a second launch, one node of two processes, resumes it and trains to STEPS.

The two-node launch runs with ``--compress bf16``: ampkit.distributed.compress_fsdp sends the gradients within each
node over an all-to-all in BF16, adds them in FP32 and carries the scaler's overflow flag (NOTE [Compressed FSDP
reduction]); the resumed launch runs with FSDP2's default reduction (its BF16 reduce-scatter, the scaler's found_inf
all-reduce). So one pair of launches records the collectives of both, and the checkpoint, which holds no transport,
moves from the one to the other.

The runs use ``--lean 8bit``: FP32 masters of every BF16 parameter, FP32 moments for the parameters under 4096
elements and 8-bit moments for the two MLP weights of each block (4096 elements each), so one pair of launches
covers masters, FP32 states and packed 8-bit states. Each rank writes a report (rank<R>.json: per step its loss, the
scale, whether the step ran, whether its own reduced grads held the Inf, sha256 digests of its shards; digests of
the whole state as saved and as loaded) and, through this file, a log of the tensor collectives it ran
(collectives-rank<R>.json). torchrun runs this file as each rank's program: under ``__main__`` it wraps
torch.distributed's tensor collectives, which FSDP2 and ampkit call, then runs the example. Everything the ranks
write goes to the test's temporary folder; each launch has a timeout, so a hang fails the test.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_fsdp2 import NEEDS_FSDP2

pytestmark = [NEEDS_FSDP2]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python" / "fsdp2_train.py"
STEPS = 12
INF_AT = 5  # the step whose gradients get the Inf...
INF_NODE = 1  # ...on the first rank of this node
SAVED_AT = 8  # the checkpoint holds the state after this many steps
LAUNCH_TIMEOUT = 150  # seconds per launch (measured: 12-16 s for two nodes, 8-10 s for one)
FSDP_GROUPS = 3  # the example shards each of its 2 blocks and then the root: 3 groups, one reduce-scatter each
# The elements of the flat gradient buffers the 3 groups reduce per step (the parameters' numel, each padded to a
# multiple of the 2 shards): what FSDP2's reduce-scatter and compress_fsdp's all-to-all both take from each rank.
GRAD_ELEMENTS = 30080
# The tolerance of the resumed run's loss against the uninterrupted one's, per step (the mean over the ranks: the
# loss of the same global batch). The state loads bit for bit, but the grads of 4 rows per rank reduce-scattered in
# BF16 over 2 ranks differ from those of 2 rows per rank reduce-scattered over 2 ranks and all-reduced over 2 nodes
# by BF16 rounding. The compression of the two-node run adds no rounding of its own on 2 shards: the FP32 sum of two
# BF16 halves is exact and rounded once to BF16, the value Gloo's BF16 sum of the two, halved, has (measured: the
# same digests at every step as the launch without --compress). Measured: at most 2.0e-4 over the 4 steps after the
# checkpoint, with and without --compress.
RESUME_TOLERANCE = 3e-3


# ---- launching ----------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, name: str, nnodes: int, args: list) -> list:
    """Starts ``nnodes`` torchrun agents of 2 processes each (one command per node, as on a cluster) running the
    example through this file, waits for them, and returns each rank's report; a launch that fails or outlives
    LAUNCH_TIMEOUT fails the test with the agents' output."""
    port = _free_port()
    report = out / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs, logs = [], []
    for node in range(nnodes):
        logs.append(out / f"{name}-node{node}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([*cmd, "--node-rank", str(node), __file__, str(EXAMPLE), *args, "--report",
                                           str(report)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:  # each agent leads its own process group: its workers go with it
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = "\n".join(f"--- {log.name}\n" + log.read_text()[-4000:] for log in logs)
    assert codes is not None, f"{name}: no exit after {LAUNCH_TIMEOUT} s\n{text}"
    assert codes == [0] * nnodes, f"{name}: exit codes {codes}\n{text}"
    ranks = 2 * nnodes
    reports = [json.loads((report / f"rank{r}.json").read_text()) for r in range(ranks)]
    collectives = [json.loads((report / f"collectives-rank{r}.json").read_text()) for r in range(ranks)]
    return [dict(r, collectives=c) for r, c in zip(reports, collectives)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("multinode")
    checkpoint = str(out / "checkpoint")
    two = _launch(out, "two-nodes", 2, ["--steps", str(STEPS), "--lean", "8bit", "--inf-at-step", str(INF_AT),
                                        "--inf-on-node", str(INF_NODE), "--save-at", str(SAVED_AT),
                                        "--checkpoint", checkpoint, "--compress", "bf16"])
    one = _launch(out, "one-node", 1, ["--steps", str(STEPS), "--lean", "8bit", "--resume", checkpoint])
    return {"two": two, "one": one}


def _global_losses(reports: list) -> list:
    """The loss of each step's global batch: the mean of the ranks' (each holds as many rows)."""
    return [sum(r["steps"][i]["loss"] for r in reports) / len(reports) for i in range(len(reports[0]["steps"]))]


# ---- the two-node run ---------------------------------------------------------------------------------------------

def test_two_nodes_form_a_two_by_two_mesh_and_the_loss_falls(runs):
    two = runs["two"]
    # a node is a row of the mesh: the ranks torchrun starts on one node (its GROUP_RANK) are consecutive
    assert [(r["rank"], r["node"], r["group_rank"], r["mesh"]) for r in two] == [
        (0, 0, 0, [2, 2]), (1, 0, 0, [2, 2]), (2, 1, 1, [2, 2]), (3, 1, 1, [2, 2])]
    assert [r["compress"] for r in two] == ["bf16"] * 4 and [r["compress"] for r in runs["one"]] == ["none"] * 2
    assert all([s["step"] for s in r["steps"]] == list(range(STEPS)) for r in two)
    losses = _global_losses(two)
    assert all(math.isfinite(x) for x in losses), losses
    # ln(64) = 4.16 is a uniform guess; 12 steps take the loss from 4.37 to 3.77 (measured)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses


def test_an_inf_on_one_node_skips_the_step_on_every_rank(runs):
    two = runs["two"]
    injected = [r["rank"] for r in two for s in r["steps"] if s["injected"]]
    assert injected == [2 * INF_NODE], "one rank of the chosen node writes the Inf"
    for r in two:
        steps = r["steps"]
        assert [s["ran"] for s in steps] == [s["step"] != INF_AT for s in steps], f"rank {r['rank']}"
        skipped, before = steps[INF_AT], steps[INF_AT - 1]
        # parameters and every optimizer state entry (masters, moments, step) as before the skipped step
        assert (skipped["params"], skipped["state"]) == (before["params"], before["state"]), f"rank {r['rank']}"
        assert all(s["params"] != p["params"] and s["state"] != p["state"]
                   for p, s in zip(steps, steps[1:]) if s["step"] != INF_AT), f"rank {r['rank']}: a step moved nothing"
        assert (skipped["scale_before"], skipped["scale"]) == (2.0**16, 2.0**15), f"rank {r['rank']}"
    assert len({tuple(s["scale"] for s in r["steps"]) for r in two}) == 1, "every rank holds the same scale"
    # The Inf, written before FSDP2 reduced the grads, sets the flag of the rank that sends it: compress_fsdp writes
    # +Inf at the head of every chunk that rank sends, so both shards of its node hold a non-finite value and, through
    # HSDP's all-reduce, both shards of the other node: every rank finds it in its own reduced grads, with no
    # all-reduce of found_inf (test_collectives_of_two_nodes_...).
    holders = [r["rank"] for r in two if r["steps"][INF_AT]["local_nonfinite"]]
    assert holders == [0, 1, 2, 3], holders
    assert not any(s["local_nonfinite"] for r in two for s in r["steps"] if s["step"] != INF_AT)


def test_replicas_on_the_two_nodes_hold_the_same_bits(runs):
    two = runs["two"]
    for i in range(STEPS):
        for shard in (0, 1):  # rank `shard` on node 0, rank `shard + 2` on node 1
            a, b = two[shard]["steps"][i], two[shard + 2]["steps"][i]
            assert (a["params"], a["state"]) == (b["params"], b["state"]), f"step {i}, shard {shard}"
            assert a["loss"] != b["loss"], "each rank trains on its own rows"
        assert two[0]["steps"][i]["params"] != two[1]["steps"][i]["params"], "the shards differ"


def test_collectives_of_two_nodes_send_bf16_grads_and_no_found_inf_flag(runs):
    """Per step, with --compress bf16: FSDP2 all-gathers the BF16 parameters within the node; compress_fsdp sends each
    group's BF16 grads (FSDP2's reduce_dtype: the parameters' dtype) over one all-to-all within the node, in place of
    FSDP2's reduce-scatter; FSDP2 all-reduces the reduced shards across the nodes in BF16. The scaler all-reduces no
    found_inf flag, on no step (the injected one included): compress_fsdp's flag is the same on every rank. Nothing
    else is sent."""
    two = runs["two"]
    for r in two:
        node = [2 * r["node"], 2 * r["node"] + 1]
        replicas = [r["rank"] % 2, r["rank"] % 2 + 2]
        seen = dict(r["collectives"])
        exchanged = seen.pop(f"all_to_all_single bfloat16 {node}")
        assert exchanged == [STEPS * FSDP_GROUPS, STEPS * GRAD_ELEMENTS], (r["rank"], exchanged)
        # half of each buffer leaves the rank (the other shard's chunk), 2 bytes an element
        assert r["compressed_bytes_sent"] == exchanged[1] // 2 * 2, r["rank"]
        reduced = seen.pop(f"all_reduce bfloat16 {replicas}")
        assert reduced == [exchanged[0], exchanged[1] // 2], (r["rank"], reduced)  # each reduced shard
        gathered = seen.pop(f"all_gather_single bfloat16 {node}")
        assert gathered[0] >= STEPS * FSDP_GROUPS, (r["rank"], gathered)
        assert not any(k.startswith("reduce_scatter") for k in seen), f"rank {r['rank']}: {seen}"
        assert f"all_reduce float32 {node}" not in seen, f"rank {r['rank']}: the scaler's found_inf all-reduce ran"
        assert not seen, f"rank {r['rank']} also sent {seen}"


# ---- the checkpoint, resumed on one node --------------------------------------------------------------------------

def test_the_checkpoint_of_two_nodes_resumes_bit_for_bit_on_one_node(runs):
    two, one = runs["two"], runs["one"]
    saved = two[0]["saved"]
    assert saved["step"] == SAVED_AT and all(r["saved"] == saved for r in two), "the same whole state on every rank"
    tensors = saved["tensors"]
    params = [name for name in tensors if " " not in name]
    for name in params:  # masters for every parameter, 8-bit or FP32 moments
        assert {f"{name} {key}" for key in ("step", "exp_avg", "exp_avg_sq", "master_param")} <= set(tensors), name
    assert saved["scaler"]["skipped_steps"] == 1 and saved["scaler"]["steps"] == SAVED_AT
    for r in one:
        assert r["mesh"] == [1, 2]
        # every parameter and state entry, whole, and the scaler, as saved
        assert r["loaded"] == saved, f"rank {r['rank']}"
        # the node's two shards are the saving nodes' two shards (8-bit rows included), bit for bit
        assert r["start"] == {k: two[r["rank"]]["steps"][SAVED_AT - 1][k] for k in ("params", "state")}


def test_collectives_of_one_node_are_fsdp2s_default_and_one_found_inf_flag_per_step(runs):
    """Per step of the resumed run, without --compress: FSDP2 reduce-scatters the same BF16 buffers within the node
    (and all-reduces the result over the one-rank replicate group of a 1 x 2 mesh); the scaler all-reduces one FP32
    flag over the node's shards."""
    steps = STEPS - SAVED_AT
    for r in runs["one"]:
        seen = dict(r["collectives"])
        scattered = seen.pop("reduce_scatter_single bfloat16 [0, 1]")
        assert scattered == [steps * FSDP_GROUPS, steps * GRAD_ELEMENTS], (r["rank"], scattered)
        reduced = seen.pop(f"all_reduce bfloat16 [{r['rank']}]")
        assert reduced == [scattered[0], scattered[1] // 2], (r["rank"], reduced)
        assert seen.pop("all_reduce float32 [0, 1]") == [steps, steps], r["rank"]  # found_inf: one element
        gathered = seen.pop("all_gather_single bfloat16 [0, 1]")
        assert gathered[0] >= steps * FSDP_GROUPS, (r["rank"], gathered)
        assert not seen, f"rank {r['rank']} also sent {seen}"
        assert "compressed_bytes_sent" not in r


def test_training_continues_on_one_node_as_on_two(runs):
    two, one = runs["two"], runs["one"]
    for r in one:
        assert [s["step"] for s in r["steps"]] == list(range(SAVED_AT, STEPS)), f"rank {r['rank']}"
        assert all(s["ran"] for s in r["steps"]) and r["steps"][-1]["state"] != r["start"]["state"]
        assert [s["scale"] for s in r["steps"]] == [s["scale"] for s in two[0]["steps"][SAVED_AT:]]
    resumed, uninterrupted = _global_losses(one), _global_losses(two)[SAVED_AT:]
    assert all(math.isfinite(x) for x in resumed), resumed
    assert all(abs(a - b) <= RESUME_TOLERANCE for a, b in zip(resumed, uninterrupted)), (resumed, uninterrupted)


# ---- each rank's program under torchrun ---------------------------------------------------------------------------

def _run_recording_collectives(argv: list) -> None:
    """Runs the example ``argv[0]`` with the arguments after it, every call of torch.distributed's tensor
    collectives counted per (collective, dtype, ranks of the group): calls and elements sent, written to
    <--report>/collectives-rank<R>.json."""
    import runpy

    import torch.distributed as dist

    counts: dict = {}

    def recording(name: str, collective, argument: str):
        signature = inspect.signature(collective)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensor, group = bound[argument], bound.get("group")
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            entry = counts.setdefault(f"{name} {str(tensor.dtype).split('.')[-1]} {ranks}", [0, 0])
            entry[0] += 1
            entry[1] += tensor.numel()
            return collective(*args, **kwargs)
        return call

    for name, argument in (("all_gather_single", "input_tensor"), ("reduce_scatter_single", "input"),
                           ("all_reduce", "tensor"), ("all_gather_into_tensor", "input_tensor"),
                           ("reduce_scatter_tensor", "input"), ("all_gather", "tensor"), ("broadcast", "tensor"),
                           ("all_to_all_single", "input")):
        setattr(dist, name, recording(name, getattr(dist, name), argument))
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    report = Path(argv[argv.index("--report") + 1])
    (report / f"collectives-rank{os.environ['RANK']}.json").write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    _run_recording_collectives(sys.argv[1:])
