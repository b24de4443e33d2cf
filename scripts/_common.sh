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
# A Debian 11 "bullseye" tower, as the oldest towers the agent claims run it
# (Python 3.9, libvirt 7.0, systemd 247, OpenSSH 8.4, QEMU 5.2), with its
# security updates: tests/box/test_bullseye_tower.py boots it as a box. Built
# once beside the forky root, seen read-only at /opt/bullseye inside it.
GH_BULLSEYE="$GH_CACHE/bullseye"
GH_BULLSEYE_PACKAGES="python3 systemd systemd-sysv dbus libpam-systemd openssh-server sudo libvirt-clients libvirt-daemon-system qemu-system-x86 procps"
# Bump when the build below changes in a way the package list does not show.
GH_BULLSEYE_LAYOUT=1

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
      if [ -f "$GH_CACHE/bullseye/.gh-bullseye" ]; then
        mkdir -p "$r/opt/bullseye"
        mount --bind -o ro "$GH_CACHE/bullseye" "$r/opt/bullseye"
        extra+=("GPU_HANDOFF_BULLSEYE_ROOT=/opt/bullseye")
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
  local pkg_stamp req_stamp bullseye=""
  [ -x "$GH_ROOT/usr/bin/python3.14" ] || gh_root_bootstrap
  gh_root_sync_host_files
  # The Debian 11 tower's root is built beside the rest (mostly downloads and
  # disk): started now, waited for at the end. Its failure fails nothing
  # here; the tests that need it say so.
  if ! gh_bullseye_ready; then
    (gh_provision_bullseye || exit 1) &
    bullseye=$!
  fi
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
  if [ -n "$bullseye" ] && ! wait "$bullseye"; then
    gh_log "no Debian 11 tower root (see $GH_CACHE/bullseye.log): the tests that boot one fail"
  fi
}

# The host's Debian security mirror (apt configuration), or nothing.
gh_apt_security_mirror() {
  local uri
  uri=$(awk '/^URIs:/ && $2 ~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$uri" ]; then
    uri=$(awk '$1 == "deb" && $0 ~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n 1 || true)
  fi
  echo "${GPU_HANDOFF_SECURITY_MIRROR:-$uri}"
}

gh_bullseye_stamp() {
  # shellcheck disable=SC2086
  printf '%s\n' "$GH_BULLSEYE_LAYOUT" $GH_BULLSEYE_PACKAGES | sha256sum | cut -c1-16
}

gh_bullseye_ready() {
  [ "$(cat "$GH_BULLSEYE/.gh-bullseye" 2>/dev/null)" = "$(gh_bullseye_stamp)" ]
}

# Builds the Debian 11 tower root once (a few minutes; cached). A failed
# build returns 1 and leaves no root, and is not tried again for the same
# packages until its mark is removed (each script would wait for it again).
gh_provision_bullseye() {
  local stamp failed="$GH_CACHE/bullseye.failed"
  gh_bullseye_ready && return 0
  stamp=$(gh_bullseye_stamp)
  if [ "$(cat "$failed" 2>/dev/null)" = "$stamp" ]; then
    gh_log "the Debian 11 tower root failed to build before (see $GH_CACHE/bullseye.log); remove $failed to try again"
    return 1
  fi
  if ! gh_bullseye_build "$stamp"; then
    echo "$stamp" >"$failed"
    return 1
  fi
  rm -f "$failed"
}

gh_bullseye_build() {
  local stamp=$1 mirror security tmp="$GH_BULLSEYE.partial" log="$GH_CACHE/bullseye.log"
  if ! command -v debootstrap >/dev/null; then
    gh_log "installing debootstrap"
    apt-get update -q >/dev/null || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null || return 1
  fi
  [ -e /usr/share/debootstrap/scripts/bullseye ] || return 1
  mirror=$(gh_apt_mirror) || return 1
  security=$(gh_apt_security_mirror)
  gh_log "building a Debian 11 (bullseye) tower root in $GH_BULLSEYE (a few minutes, once)"
  rm -rf "$tmp" "$GH_BULLSEYE"
  debootstrap --variant=minbase bullseye "$tmp" "$mirror" >"$log" 2>&1 || return 1
  echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/99gpu-handoff"
  # Packages installed here must not start services; dpkg need not sync
  # each file of a root that is thrown away if the build fails (both undone
  # below: a tower has neither).
  printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  echo force-unsafe-io >"$tmp/etc/dpkg/dpkg.cfg.d/99gpu-handoff"
  {
    echo "deb $mirror bullseye main"
    echo "deb $mirror bullseye-updates main"
    if [ -n "$security" ]; then echo "deb $security bullseye-security main"; fi
  } >"$tmp/etc/apt/sources.list"
  cp /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
  mkdir -p "$tmp/etc/ssl/certs"
  if [ -r /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$tmp/etc/ssl/certs/ca-certificates.crt"
  fi
  # shellcheck disable=SC2086
  unshare --mount --pid --fork --propagation private --kill-child sh -ec '
    r=$1; shift
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
      DEBIAN_FRONTEND=noninteractive sh -ec "
        apt-get update -q
        apt-get full-upgrade -y -q --no-install-recommends
        apt-get install -y -q --no-install-recommends \$*
        apt-get clean" sh "$@"
  ' gh-bullseye "$tmp" $GH_BULLSEYE_PACKAGES >>"$log" 2>&1 || return 1
  rm -rf "$tmp/var/lib/apt/lists"/* "$tmp/usr/sbin/policy-rc.d" "$tmp/etc/dpkg/dpkg.cfg.d/99gpu-handoff"
  # The box shares the machine's network: libvirt's default network (a
  # bridge, firewall rules, dnsmasq) must not start in it.
  rm -f "$tmp/etc/libvirt/qemu/networks/autostart/default.xml"
  # Where a box mounts the repository.
  mkdir -p "$tmp/src"
  echo "$stamp" >"$tmp/.gh-bullseye"
  mv "$tmp" "$GH_BULLSEYE"
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
