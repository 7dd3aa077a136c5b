"""Launchers without a cluster: local rank and GPU choice per launcher's
environment, Slurm node lists to ``horovodrun -H``, and the Slurm recipe's
command line (examples/launch/slurm.sbatch run with a simulated allocation).
"""
import os
import subprocess
import sys

import pytest

import tfhybrid
from tfhybrid import launch_hosts, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(ROOT, "examples", "launch", "slurm.sbatch")

# What each launcher sets for the process of node-local rank 2 (of 4 per node),
# including the variables it inherits from the launcher that started it.
LAUNCHERS = {
    "horovodrun": {"HOROVOD_LOCAL_RANK": "2", "HOROVOD_RANK": "6"},
    "horovodrun inside sbatch": {"HOROVOD_LOCAL_RANK": "2", "SLURM_LOCALID": "0",
                                 "SLURM_PROCID": "0"},
    "Open MPI mpirun": {"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_RANK": "6"},
    "mpirun inside sbatch": {"OMPI_COMM_WORLD_LOCAL_RANK": "2", "SLURM_LOCALID": "0"},
    "MPICH Hydra": {"MPI_LOCALRANKID": "2", "PMI_RANK": "6"},
    "PMI": {"PMI_LOCAL_RANK": "2", "PMI_RANK": "6"},
    "MVAPICH2": {"MV2_COMM_WORLD_LOCAL_RANK": "2"},
    "Cray PALS": {"PALS_LOCAL_RANKID": "2"},
    "srun": {"SLURM_LOCALID": "2", "SLURM_PROCID": "6"},
    "srun --mpi=pmix (Open MPI)": {"SLURM_LOCALID": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_local_rank_and_gpu_per_launcher(launcher):
    local, var = runtime.local_rank_from_env(LAUNCHERS[launcher])
    assert local == 2, (launcher, var)
    assert runtime.gpu_for_local_rank(local, 4) == 2          # 4 GPUs visible: its own
    assert runtime.gpu_for_local_rank(local, 1) == 0          # launcher gave it one GPU
    assert runtime.gpu_for_local_rank(local, 0) is None       # CPU node


def test_no_launcher_is_local_rank_zero_and_srun_no_longer_means_gpu0():
    assert runtime.local_rank_from_env({}) == (0, None)
    assert runtime.local_rank_from_env({"SLURM_LOCALID": ""}) == (0, None)
    # Under srun only SLURM_LOCALID is set: each rank takes its own GPU.
    picks = [runtime.gpu_for_local_rank(runtime.local_rank_from_env({"SLURM_LOCALID": str(r)})[0], 4)
             for r in range(4)]
    assert picks == [0, 1, 2, 3]
    # More processes than GPUs: round-robin.
    assert [runtime.gpu_for_local_rank(r, 2) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("value", ["abc", "-1", "1.5"])
def test_bad_local_rank_variable_names_it(value):
    with pytest.raises(ValueError, match=rf"SLURM_LOCALID='{value}'.*non-negative integer"):
        runtime.local_rank_from_env({"SLURM_LOCALID": value})


def test_public_local_rank(monkeypatch):
    assert "local_rank" in tfhybrid.__all__ and tfhybrid.local_rank is runtime.local_rank
    for name, _ in runtime.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    tfhybrid.shutdown()
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert tfhybrid.local_rank() == 3


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("single", ["single"]),
    ("a1,b2", ["a1", "b2"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[1,1-2]", ["x1", "x2"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert launch_hosts.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, phrase", [
    ("", "empty nodelist"), ("node[1-3", "never closed"), ("node1-3]", "without '\\['"),
    ("node[3-1]", "ends below its start"), ("node[a-b]", "is not N or N-M"),
    ("a,,b", "empty host name"), ("n[[1]]", "nested"),
])
def test_bad_nodelist(nodelist, phrase):
    with pytest.raises(ValueError, match=phrase):
        launch_hosts.expand_nodelist(nodelist)


def test_tasks_per_node_and_hosts():
    assert launch_hosts.expand_tasks_per_node("4(x3),2") == [4, 4, 4, 2]
    assert launch_hosts.expand_tasks_per_node("2", n_nodes=3) == [2, 2, 2]
    with pytest.raises(ValueError, match="N or N\\(xK\\)"):
        launch_hosts.expand_tasks_per_node("4x2")
    env = {"SLURM_JOB_NODELIST": "node[01-03,7],gpu5", "SLURM_TASKS_PER_NODE": "4(x4),2"}
    hosts, slots = launch_hosts.hosts_from_env(env)
    assert launch_hosts.horovod_hosts(hosts, slots) == \
        "node01:4,node02:4,node03:4,node7:4,gpu5:2"
    assert launch_hosts.hosts_from_env(env, slots=8)[1] == [8] * 5
    with pytest.raises(ValueError, match="5 hosts .* but 2 slot counts"):
        launch_hosts.hosts_from_env({"SLURM_JOB_NODELIST": "n[1-5]", "SLURM_TASKS_PER_NODE": "4,2"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not set"):
        launch_hosts.hosts_from_env({})


def _module(args, env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "tfhybrid.launch_hosts", *args], env=full,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_launch_hosts_module():
    env = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert _module([], env).stdout.strip() == "gpu1:4,gpu2:4"
    assert _module(["--np"], env).stdout.strip() == "8"
    assert _module(["--hostfile"], env).stdout.splitlines() == ["gpu1 slots=4", "gpu2 slots=4"]
    bad = _module([], {})
    assert bad.returncode == 2 and "SLURM_JOB_NODELIST is not set" in bad.stderr


def _sbatch(env, *args):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update({"TFHYBRID_DRY_RUN": "1", "SLURM_SUBMIT_DIR": ROOT,
                 "TFHYBRID_PYTHON": sys.executable}, **env)
    return subprocess.run(["bash", SBATCH, *args], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_slurm_recipe_horovodrun_command():
    run = _sbatch({"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"},
                  "examples/train_digits.py", "--epochs", "1")
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert "horovodrun --gloo -np 8 -H node01:4,node02:4" in line
    assert line.endswith("examples/train_digits.py --epochs 1")


def test_slurm_recipe_srun_command():
    run = _sbatch({"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)",
                   "TFHYBRID_LAUNCHER": "srun"})
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("srun --mpi=pmix") and line.endswith("examples/train_digits.py")
    bad = _sbatch({"SLURM_JOB_NODELIST": "n1", "TFHYBRID_LAUNCHER": "ssh"})
    assert bad.returncode == 2 and "TFHYBRID_LAUNCHER=ssh" in bad.stderr


def test_mpijob_recipe():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(open(os.path.join(ROOT, "examples", "launch", "mpijob.yaml")))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    worker_spec = spec["mpiReplicaSpecs"]["Worker"]
    worker = worker_spec["template"]["spec"]["containers"][0]
    # args, not command: the image's entrypoint sets up ssh in every pod.
    assert "command" not in launcher and "command" not in worker
    assert worker["args"] == ["sshd"]
    args = launcher["args"]
    assert args[0] == "mpirun" and "--allow-run-as-root" in args
    np_ = int(args[args.index("-np") + 1])
    assert np_ == worker_spec["replicas"] * spec["slotsPerWorker"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == spec["slotsPerWorker"]
    assert launcher["image"] == worker["image"]
    assert spec["sshAuthMountPath"] == "/root/.ssh"
    script = args[args.index("python") + 1]
    assert os.path.exists(os.path.join(ROOT, script)), script
