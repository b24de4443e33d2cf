# shellcheck shell=bash
# Shared by scripts/setup, scripts/test, scripts/env and scripts/demo: find or
# provision Python >= 3.14.2 with the project's pinned tools, then run commands
# in that environment.
#
# Three ways, tried in order:
#   1. python3.14 (>= 3.14.2) on PATH: a virtualenv in .venv; system tools
#      (virsh, qemu, sshd) come from the host.
#   2. uv on PATH: uv provides Python 3.14 and the virtualenv in .venv.
#   3. Debian-family host, running as root: a Debian "forky" root file system
#      built with debootstrap from the host's own apt mirror, holding Python
#      3.14, libvirt, QEMU and OpenSSH; commands run inside it in private mount
#      and PID namespaces, so nothing is left mounted or running afterwards.
set -euo pipefail

GH_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GH_MIN_PYTHON="3.14.2"
GH_REQUIREMENTS="$GH_REPO/requirements_test.txt"
GH_SYSTEM_PACKAGES="$GH_REPO/scripts/system-packages.txt"
if [ "$(id -u)" = 0 ]; then
  GH_CACHE=${GPU_HANDOFF_CACHE:-/var/cache/gpu-handoff}
else
  GH_CACHE=${GPU_HANDOFF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-handoff}
fi
GH_ROOT="$GH_CACHE/forky"

gh_log() { printf '%s\n' "gpu-handoff: $*" >&2; }
gh_die() { gh_log "$*"; exit 1; }

gh_python_ok() {
  "$1" -c "import sys; sys.exit(0 if sys.version_info >= (3, 14, 2) else 1)" 2>/dev/null
}

# Which of the three ways this machine takes; GPU_HANDOFF_MODE overrides.
gh_mode() {
  if [ -n "${GPU_HANDOFF_MODE:-}" ]; then
    echo "$GPU_HANDOFF_MODE"
  elif command -v python3.14 >/dev/null && gh_python_ok python3.14; then
    echo native
  elif command -v uv >/dev/null; then
    echo uv
  elif [ "$(id -u)" = 0 ] && [ -r /etc/debian_version ]; then
    echo root
  else
    gh_die "no Python >= $GH_MIN_PYTHON found. Install python3.14 (>= $GH_MIN_PYTHON) or uv, or run as root on a Debian-family machine so the scripts can build a Debian root file system with it."
  fi
}

gh_stamp() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

# --- native and uv modes ----------------------------------------------------
gh_provision_venv() {
  local mode=$1 venv="$GH_REPO/.venv" stamp
  stamp=$(gh_stamp "$GH_REQUIREMENTS")
  if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then
    return 0
  fi
  gh_log "creating $venv ($mode)"
  if [ "$mode" = uv ]; then
    uv venv --python ">=$GH_MIN_PYTHON,<3.15" "$venv"
    VIRTUAL_ENV="$venv" uv pip install -r "$GH_REQUIREMENTS"
  else
    python3.14 -m venv "$venv"
    "$venv/bin/pip" install --disable-pip-version-check -r "$GH_REQUIREMENTS"
  fi
  echo "$stamp" >"$venv/.stamp"
}

# --- root mode ---------------------------------------------------------------
# The host's Debian mirror, read from its apt configuration at run time.
gh_apt_mirror() {
  local uri
  uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$uri" ]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n 1 || true)
  fi
  [ -n "$uri" ] || gh_die "cannot read a Debian mirror from /etc/apt; set GPU_HANDOFF_MIRROR"
  echo "${GPU_HANDOFF_MIRROR:-$uri}"
}

# Copies what the root needs from the host to reach the package registries.
gh_root_sync_host_files() {
  cp /etc/resolv.conf "$GH_ROOT/etc/resolv.conf" 2>/dev/null || true
  # The host bundle may hold a local CA that the registries' proxies use.
  if [ -r /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$GH_ROOT/etc/ssl/certs/ca-certificates.crt"
  fi
  if [ -r /etc/pip.conf ]; then cp /etc/pip.conf "$GH_ROOT/etc/pip.conf"; fi
}

gh_root_bootstrap() {
  local mirror script=/usr/share/debootstrap/scripts/sid tmp="$GH_ROOT.partial"
  if ! command -v debootstrap >/dev/null; then
    gh_log "installing debootstrap"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null
  fi
  command -v unshare >/dev/null || gh_die "unshare (util-linux) is missing"
  mirror=$(gh_apt_mirror)
  gh_log "building a Debian forky root with Python 3.14 in $GH_ROOT (about a minute)"
  rm -rf "$tmp"
  mkdir -p "$GH_CACHE"
  # Older debootstrap has no forky script; forky bootstraps like sid.
  [ -e /usr/share/debootstrap/scripts/forky ] && script=/usr/share/debootstrap/scripts/forky
  debootstrap --variant=minbase --include=python3.14,python3.14-venv,ca-certificates \
    forky "$tmp" "$mirror" "$script" >"$GH_CACHE/debootstrap.log" 2>&1 ||
    gh_die "debootstrap failed; see $GH_CACHE/debootstrap.log"
  # Mirrors that serve snapshots carry Release files past their Valid-Until.
  echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/99gpu-handoff"
  # Packages installed into the root must not start services.
  printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  mv "$tmp" "$GH_ROOT"
}

# Runs a command inside the root: private mount and PID namespaces, the
# repository at /src, the cache at /cache. Everything mounted or started in
# there ends with the command.
gh_root_exec() {
  local workdir=$1; shift
  local oldpy="" oldprefix=""
  oldpy=$(gh_oldest_host_python || true)
  if [ -n "$oldpy" ]; then
    oldprefix=$("$oldpy" -c 'import sys; print(sys.base_prefix)' 2>/dev/null || true)
  fi
  mkdir -p "$GH_CACHE/shared"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
    CI="${CI:-}" GH_ROOT="$GH_ROOT" GH_REPO="$GH_REPO" GH_CACHE="$GH_CACHE" GH_WORKDIR="$workdir" \
    GH_OLDPREFIX="$oldprefix" GH_OLDPY="${oldpy##*/}" \
    GH_PASS_ENV="$(env | grep -E '^(GPU_HANDOFF_[A-Z_]*|PYTEST_ADDOPTS|PIP_(INDEX_URL|EXTRA_INDEX_URL|TRUSTED_HOST|DEFAULT_TIMEOUT)|https?_proxy|HTTPS?_PROXY|no_proxy|NO_PROXY)=' | tr '\n' '\v' || true)" \
    unshare --mount --pid --fork --propagation private --kill-child bash -c '
      set -e
      r=$GH_ROOT
      mount -t proc proc "$r/proc"
      mount --rbind /dev "$r/dev"
      mount --rbind /sys "$r/sys"
      mount -t tmpfs tmpfs "$r/run"
      mount -t tmpfs tmpfs "$r/tmp"
      mkdir -p "$r/src" "$r/cache" "$r/opt/oldpython"
      mount --bind "$GH_REPO" "$r/src"
      mount --bind "$GH_CACHE/shared" "$r/cache"
      extra=()
      if [ -n "$GH_OLDPREFIX" ] && [ -d "$GH_OLDPREFIX" ]; then
        mount --bind -o ro "$GH_OLDPREFIX" "$r/opt/oldpython"
        # Its libpython where the loader looks without being told, as a
        # tower'"'"'s own Python finds its library: the agent'"'"'s runners start
        # with systemd'"'"'s environment, not the caller'"'"'s.
        for lib in "$GH_OLDPREFIX"/lib/libpython3*.so.1.0; do
          [ -f "$lib" ] || continue
          [ -e "$r/usr/lib/${lib##*/}" ] || : > "$r/usr/lib/${lib##*/}"
          mount --bind -o ro "$lib" "$r/usr/lib/${lib##*/}"
        done
        extra+=("GPU_HANDOFF_OLD_PYTHON=/opt/oldpython/bin/$GH_OLDPY" "GPU_HANDOFF_OLD_PYTHON_LIB=/opt/oldpython/lib")
      fi
      while IFS= read -r -d $'"'"'\v'"'"' kv; do extra+=("$kv"); done <<<"$GH_PASS_ENV"
      # A background job would read /dev/null instead of our stdin; keep the
      # stdin we have (CI may start us with none at all).
      { exec 3<&0; } 2>/dev/null || exec 3</dev/null
      # This shell stays PID 1 of the namespace: it reaps orphaned processes
      # (libvirtd hangs on zombie QEMU probes otherwise) and passes signals on.
      chroot "$r" /usr/bin/env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root TERM="$TERM" LANG=C.UTF-8 CI="$CI" GPU_HANDOFF_ENV=root \
        GPU_HANDOFF_REQUIRE_SYSTEM=1 GPU_HANDOFF_CACHE_DIR=/cache "${extra[@]}" \
        /bin/sh -c "cd \"\$0\" && exec \"\$@\"" "$GH_WORKDIR" "$@" <&3 &
      child=$!
      trap '"'"'kill -TERM "$child" 2>/dev/null'"'"' TERM INT HUP
      rc=0
      while kill -0 "$child" 2>/dev/null; do
        wait "$child" && rc=0 || rc=$?
      done
      exit "$rc"
    ' gh-root "$@"
}

gh_provision_root() {
  local pkg_stamp req_stamp
  [ -x "$GH_ROOT/usr/bin/python3.14" ] || gh_root_bootstrap
  gh_root_sync_host_files
  pkg_stamp=$(gh_stamp "$GH_SYSTEM_PACKAGES")
  if [ "$(cat "$GH_ROOT/.gh-packages" 2>/dev/null)" != "$pkg_stamp" ]; then
    gh_log "installing system packages into the root"
    # shellcheck disable=SC2046
    gh_root_exec / sh -c 'apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null' \
      apt $(grep -v '^#' "$GH_SYSTEM_PACKAGES")
    echo "$pkg_stamp" >"$GH_ROOT/.gh-packages"
  fi
  # libvirtd refuses to start without this account (Debian's
  # libvirt-daemon-system would create it; the tests run libvirtd privately).
  if ! grep -q '^libvirt-qemu:' "$GH_ROOT/etc/passwd"; then
    chroot "$GH_ROOT" useradd --system --no-create-home --user-group --shell /usr/sbin/nologin libvirt-qemu
  fi
  # The tower agent's tests run the SSH side as this unprivileged account and
  # the libvirt hook as root, as on a real tower. sshd runs a forced command
  # through the account's shell and refuses a locked password ("!"): so a
  # real shell and "*" (no password, not locked).
  if ! grep -q '^gpu-handoff-user:' "$GH_ROOT/etc/passwd"; then
    chroot "$GH_ROOT" useradd --create-home --user-group --shell /bin/sh --password '*' gpu-handoff-user
  fi
  req_stamp=$(gh_stamp "$GH_REQUIREMENTS")
  if [ "$(cat "$GH_ROOT/opt/venv/.stamp" 2>/dev/null)" != "$req_stamp" ]; then
    gh_log "installing the Python tool chain into the root (about a minute and a half)"
    rm -rf "$GH_ROOT/opt/venv"
    gh_root_exec / sh -c 'python3.14 -m venv /opt/venv && /opt/venv/bin/pip install -q --disable-pip-version-check -r /src/requirements_test.txt'
    echo "$req_stamp" >"$GH_ROOT/opt/venv/.stamp"
  fi
}

# The oldest Python 3 (>= 3.9) on the host, for the tower agent's
# compatibility test: the agent must run on the Python of an old tower.
gh_oldest_host_python() {
  local v p
  for v in 3.9 3.10 3.11 3.12; do
    for p in $(command -v "python$v" 2>/dev/null) "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v"; do
      if [ -x "$p" ] && "$p" -c 'import sys' 2>/dev/null; then
        echo "$p"
        return 0
      fi
    done
  done
  return 1
}

# Provisioning builds into shared places (the Debian root and its .partial
# directory, .venv): scripts started at once on a fresh machine (scripts/test
# and scripts/demo) take turns, through a lock file in the cache. The lock is
# released as soon as the environment is ready, not held while it is used.
gh_provision() {
  local lock_fd=""
  GH_MODE=$(gh_mode)
  if command -v flock >/dev/null; then
    mkdir -p "$GH_CACHE"
    exec {lock_fd}>>"$GH_CACHE/provision.lock"
    if ! flock -n "$lock_fd"; then
      gh_log "another script is provisioning: waiting for it ($GH_CACHE/provision.lock)"
      flock "$lock_fd"
    fi
  fi
  case "$GH_MODE" in
    native | uv) gh_provision_venv "$GH_MODE" ;;
    root) gh_provision_root ;;
    *) gh_die "unknown GPU_HANDOFF_MODE '$GH_MODE' (native, uv or root)" ;;
  esac
  if [ -n "$lock_fd" ]; then
    flock -u "$lock_fd"
    exec {lock_fd}>&-
  fi
}

# Runs a command in the provisioned environment, in the repository.
gh_exec() {
  case "$GH_MODE" in
    native | uv)
      cd "$GH_REPO"
      PATH="$GH_REPO/.venv/bin:$PATH" GPU_HANDOFF_ENV="$GH_MODE" "$@"
      ;;
    root) gh_root_exec /src "$@" ;;
  esac
}
