#!/usr/bin/env bash
# Entry point of the tfhybrid images (docker/Dockerfile.cpu, docker/Dockerfile.gpu).
#
#   docker run IMAGE                         tfhybrid --help
#   docker run IMAGE plan vgg16 --np 8 --batch 256     a tfhybrid subcommand (plan, calibrate, ...)
#   docker run IMAGE tfhybrid ARGS           the same, spelled out
#   docker run IMAGE sshd                    only the SSH server, in the foreground: a remote
#                                            target of horovodrun/mpirun on another node
#   docker run IMAGE horovodrun -np 8 -H a:4,b:4 python train.py    any other command as is
#
# SSH (for `sshd`, or any command when TFHYBRID_SSHD=1 starts the server in the background):
#   TFHYBRID_SSH_PORT  port of the server and default port of the ssh client (default 2222,
#                      so that the image can share a host's network with the host's sshd);
#                      every node of a job must use the same port.
#   TFHYBRID_SSH_KEYS  directory mounted read-only with `authorized_keys` (who may log in)
#                      and optionally a private key `id_ed25519` / `id_rsa` (for the node that
#                      runs horovodrun); copied into /root/.ssh with the modes ssh requires.
#                      Default /etc/tfhybrid/ssh. Keys already in /root/.ssh (the Kubernetes
#                      MPI Operator mounts them there) are used as they are.
#   Host keys are generated at start when none were mounted (/etc/ssh/ssh_host_*).
set -euo pipefail

SSH_PORT=${TFHYBRID_SSH_PORT:-2222}
SSH_KEYS=${TFHYBRID_SSH_KEYS:-/etc/tfhybrid/ssh}
# Tests only (tests/unit/test_docker_files.py): write under a scratch root, run another sshd.
R=${TFHYBRID_ENTRYPOINT_ROOT:-}
SSHD=${TFHYBRID_ENTRYPOINT_SSHD:-/usr/sbin/sshd}
# Server policy (keys only), shared with the test hosts of tests/multihost/hosts.py.
SSHD_POLICY=$(dirname "$(readlink -f "$0")")/sshd_config
SUBCOMMANDS_RE='^(plan|calibrate|-h|--help|--version)$'

die() { echo "[entrypoint] error: $*" >&2; exit 2; }

setup_ssh() {
  case "$SSH_PORT" in ''|*[!0-9]*) die "TFHYBRID_SSH_PORT=$SSH_PORT: expected a port number, e.g. 2222" ;; esac
  mkdir -p "$R/root/.ssh" "$R/run/sshd" "$R/etc/ssh/sshd_config.d" "$R/etc/ssh/ssh_config.d"
  if [ -d "$SSH_KEYS" ]; then
    for f in authorized_keys id_ed25519 id_ed25519.pub id_rsa id_rsa.pub; do
      if [ -f "$SSH_KEYS/$f" ] && [ ! -e "$R/root/.ssh/$f" ]; then
        install -m 600 "$SSH_KEYS/$f" "$R/root/.ssh/$f"
      fi
    done
  fi
  if [ -w "$R/root/.ssh" ]; then chmod 700 "$R/root/.ssh"; fi
  if ! ls "$R"/etc/ssh/ssh_host_*_key >/dev/null 2>&1; then
    if [ -n "$R" ]; then ssh-keygen -q -A -f "$R" >/dev/null; else ssh-keygen -q -A >/dev/null; fi
  fi
  [ -e "$R/root/.ssh/authorized_keys" ] \
    || echo "[entrypoint] warning: no /root/.ssh/authorized_keys: mount one in $SSH_KEYS; nobody can log in" >&2
  # Server: our port, then the policy shared with the test hosts (docker/sshd_config).
  { printf 'Port %s\n' "$SSH_PORT"; cat "$SSHD_POLICY"; } > "$R/etc/ssh/sshd_config.d/tfhybrid.conf"
  # Remote commands (horovodrun's, mpirun's orted) get the image's environment, not a login shell's.
  env | grep -E '^(PATH|LD_LIBRARY_PATH|PYTHONPATH|VIRTUAL_ENV|TF_[A-Z_]*|NCCL_[A-Z_]*|HOROVOD_[A-Z_]*|OMPI_[A-Z_]*|CUDA_[A-Z_]*|NVIDIA_[A-Z_]*|TFHYBRID_[A-Z_]*)=' \
    > "$R/etc/environment" || true
}

setup_ssh_client() {
  # Every container of a job (launcher too): ssh to the job's port, no host-key prompts.
  case "$SSH_PORT" in ''|*[!0-9]*) die "TFHYBRID_SSH_PORT=$SSH_PORT: expected a port number, e.g. 2222" ;; esac
  if mkdir -p "$R/etc/ssh/ssh_config.d" 2>/dev/null && [ -w "$R/etc/ssh/ssh_config.d" ]; then
    printf 'Host *\n    Port %s\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n' \
      "$SSH_PORT" > "$R/etc/ssh/ssh_config.d/tfhybrid.conf"
  fi
}

setup_ssh_client
if [ $# -eq 0 ]; then
  set -- tfhybrid --help
elif [[ "$1" =~ $SUBCOMMANDS_RE ]]; then
  set -- tfhybrid "$@"
fi

if [ "$1" = sshd ]; then
  setup_ssh
  echo "[entrypoint] sshd listening on port $SSH_PORT" >&2
  exec "$SSHD" -D -e -p "$SSH_PORT"
fi
if [ "${TFHYBRID_SSHD:-0}" = 1 ]; then
  setup_ssh
  "$SSHD" -e -p "$SSH_PORT"
fi
exec "$@"
