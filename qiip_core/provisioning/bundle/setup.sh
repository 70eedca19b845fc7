#!/usr/bin/env bash
# Turn a bare host into an inference node: base packages, NVIDIA driver, CUDA toolkit, the engine, the shared
# model cache, the firewall rule. Idempotent: a step already done with the same pinned versions is skipped.
#
# Environment (set by the gateway; see qiip_core.provisioning.BundleParameters):
#   QIIPNODE_ENGINE          llamacpp | vllm | ollama
#   QIIPNODE_PROFILE         cuda | cpu (cpu: a test profile; refused on a host with an NVIDIA GPU)
#   QIIPNODE_DRIVER_VERSION, QIIPNODE_DRIVER_SHA256, QIIPNODE_DRIVER_URL   the pinned NVIDIA driver (cuda)
#   QIIPNODE_CUDA_PACKAGE    the CUDA toolkit package (cuda)
#   QIIPNODE_VLLM_VERSION, QIIPNODE_PIP_INDEX                                vLLM in /opt/vllm-venv
#   QIIPNODE_LLAMACPP_VERSION, QIIPNODE_LLAMACPP_SHA256, QIIPNODE_LLAMACPP_ARCHIVE  llama.cpp's source
#   QIIPNODE_OLLAMA_VERSION, QIIPNODE_OLLAMA_SHA256, QIIPNODE_OLLAMA_URL     Ollama's pinned release (no SHA-256:
#                            the host's installed `ollama`, which must report that version)
#   QIIPNODE_NFS_EXPORT      server:/path of the shared model cache (empty: none)
#   QIIPNODE_MODEL_DIR       where the shared model cache is mounted
#   QIIPNODE_ENGINE_PORT     the engine's TCP port
#   QIIPNODE_PACKAGE_LOCK_WAIT_S  how long to wait for the package manager's lock (another upgrade running)
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"

ENGINE="${QIIPNODE_ENGINE:?QIIPNODE_ENGINE is required}"
PROFILE="${QIIPNODE_PROFILE:-cuda}"
FAMILY="$(os_family)"

step_start system_update
case "$FAMILY" in
  rhel) packages="gcc-c++ cmake make git curl tar python3 nfs-utils pciutils" ;;
  debian) packages="build-essential cmake git curl tar python3-venv nfs-common pciutils" ;;
  *) step_fail system_update "unsupported OS: only the RHEL and Debian/Ubuntu families are provisioned" ;;
esac
# Ollama's newer releases are .tar.zst archives.
[[ "$ENGINE" == ollama ]] && packages="$packages zstd"
# A package manager busy elsewhere (unattended upgrades on a host that just booted) is waited for, within bounds.
package_manager_free() {
  wait_package_manager "$FAMILY" || step_fail "$1" "the package manager is still busy after \
${QIIPNODE_PACKAGE_LOCK_WAIT_S:-600} s: process ${PACKAGE_LOCK_HOLDER%% *} holds ${PACKAGE_LOCK_HOLDER#* }; retry when it \
finishes"
}

if done_as system_update "$FAMILY $packages"; then
  step_ok system_update "already done"
else
  package_manager_free system_update
  if [[ "$FAMILY" == rhel ]]; then
    # shellcheck disable=SC2086
    dnf install -y $packages || step_fail system_update "dnf could not install: $packages"
  else
    export DEBIAN_FRONTEND=noninteractive
    # apt waits for its own locks too (apt 1.9.11 and later), should another upgrade start in between.
    apt_wait=(-o "DPkg::Lock::Timeout=${QIIPNODE_PACKAGE_LOCK_WAIT_S:-600}")
    apt-get "${apt_wait[@]}" update -q || step_fail system_update "apt-get update failed"
    # shellcheck disable=SC2086
    apt-get "${apt_wait[@]}" install -y -q $packages || step_fail system_update "apt-get could not install: $packages"
  fi
  mark_done system_update "$FAMILY $packages"
  step_ok system_update
fi

step_start nvidia_driver
if [[ "$PROFILE" == cpu ]]; then
  has_gpu && step_fail nvidia_driver "the cpu profile was asked for on a host with an NVIDIA GPU; use the cuda profile"
  step_warn nvidia_driver "skipped: cpu profile"
else
  want="${QIIPNODE_DRIVER_VERSION:?}"
  have="$(driver_version)"
  if [[ -n "$have" && "$have" != "$want" ]]; then
    step_fail nvidia_driver "driver $have is installed, not the pinned $want; remove it or change the pin"
  elif [[ "$have" == "$want" ]]; then
    step_ok nvidia_driver "driver $want already installed"
  else
    installer="$STATE_DIR/NVIDIA-Linux-$want.run"
    url="${QIIPNODE_DRIVER_URL:?}"
    curl -fsSL --retry 3 -o "$installer.part" "$url" || step_fail nvidia_driver "cannot download $(redact_url "$url")"
    got="$(sha256sum "$installer.part" | cut -d' ' -f1)"
    if [[ "$got" != "${QIIPNODE_DRIVER_SHA256:?}" ]]; then
      rm -f "$installer.part"
      step_fail nvidia_driver "the driver installer's sha256 is $got, not the pinned $QIIPNODE_DRIVER_SHA256"
    fi
    mv "$installer.part" "$installer"
    sh "$installer" --silent --dkms || step_fail nvidia_driver "the driver installer failed"
    have="$(driver_version)"
    [[ "$have" == "$want" ]] || step_fail nvidia_driver "after installing, nvidia-smi reports driver '${have:-none}'"
    step_ok nvidia_driver "driver $want installed"
  fi
fi

step_start cuda_toolkit
if [[ "$PROFILE" == cpu ]]; then
  step_warn cuda_toolkit "skipped: cpu profile"
elif done_as cuda_toolkit "${QIIPNODE_CUDA_PACKAGE:?}"; then
  step_ok cuda_toolkit "already done"
else
  package_manager_free cuda_toolkit
  if [[ "$FAMILY" == rhel ]]; then
    dnf install -y "$QIIPNODE_CUDA_PACKAGE" || step_fail cuda_toolkit "dnf could not install $QIIPNODE_CUDA_PACKAGE"
  else
    apt-get -o "DPkg::Lock::Timeout=${QIIPNODE_PACKAGE_LOCK_WAIT_S:-600}" install -y -q "$QIIPNODE_CUDA_PACKAGE" || step_fail cuda_toolkit "apt-get could not install $QIIPNODE_CUDA_PACKAGE"
  fi
  mark_done cuda_toolkit "$QIIPNODE_CUDA_PACKAGE"
  step_ok cuda_toolkit
fi

if [[ "$ENGINE" == vllm ]]; then
  step_start vllm_install
  venv="$ROOT/opt/vllm-venv"
  version="${QIIPNODE_VLLM_VERSION:?}"
  if [[ -x "$venv/bin/vllm" && "$(cat "$venv/.qiip-vllm-version" 2>/dev/null)" == "$version" ]]; then
    step_ok vllm_install "vLLM $version already installed"
  else
    python3 -m venv "$venv" || step_fail vllm_install "cannot create the virtual environment $venv"
    "$venv/bin/pip" install -q --index-url "${QIIPNODE_PIP_INDEX:-https://pypi.org/simple}" "vllm==$version" ||
      step_fail vllm_install "pip could not install vllm==$version"
    printf '%s' "$version" >"$venv/.qiip-vllm-version"
    step_ok vllm_install "vLLM $version installed"
  fi
elif [[ "$ENGINE" == ollama ]]; then
  step_start ollama_install
  version="${QIIPNODE_OLLAMA_VERSION:?}"
  sha="${QIIPNODE_OLLAMA_SHA256:-}"
  if [[ -n "$sha" ]]; then
    prefix="$ROOT/opt/ollama/$version"
    if [[ -x "$prefix/bin/ollama" && "$(cat "$prefix/.qiip-ollama-sha256" 2>/dev/null)" == "$sha" ]]; then
      step_ok ollama_install "Ollama $version already installed"
    else
      case "$(uname -m)" in
        x86_64) arch=amd64 ;;
        aarch64) arch=arm64 ;;
        *) step_fail ollama_install "no Ollama release for $(uname -m)" ;;
      esac
      url="${QIIPNODE_OLLAMA_URL:?}"
      url="${url//\{version\}/$version}"
      url="${url//\{arch\}/$arch}"
      archive="$STATE_DIR/ollama-release"
      curl --fail --silent --show-error --location --proto '=https,http' -o "$archive" "$url" ||
        step_fail ollama_install "cannot download $(redact_url "$url")"
      got="$(sha256sum "$archive" | cut -d' ' -f1)"
      if [[ "$got" != "$sha" ]]; then
        rm -f "$archive"
        step_fail ollama_install "the release archive's sha256 is $got, not the pinned $sha (provisioning.ollama_sha256)"
      fi
      # Extracted beside the install and moved into place whole: a run ended halfway leaves no half an install.
      rm -rf "$prefix.partial" && mkdir -p "$prefix.partial"
      # Owned by root with the archive's modes less group and other write, whoever packed it; what a failed run
      # leaves goes at once.
      untar=(tar --no-same-owner --no-same-permissions -C "$prefix.partial")
      case "${url%%[?#]*}" in
        *.tar.zst) zstd -dc "$archive" | "${untar[@]}" -xf - ;;
        *) "${untar[@]}" -xzf "$archive" ;;
      esac || { rm -rf "$archive" "$prefix.partial"; step_fail ollama_install "cannot extract the release archive"; }
      chmod -R go-w "$prefix.partial"
      if [[ ! -f "$prefix.partial/bin/ollama" || -L "$prefix.partial/bin/ollama" || ! -x "$prefix.partial/bin/ollama" ]]; then
        rm -rf "$archive" "$prefix.partial"
        step_fail ollama_install "the release archive has no executable file bin/ollama"
      fi
      printf '%s' "$sha" >"$prefix.partial/.qiip-ollama-sha256"
      rm -rf "$prefix" && mv "$prefix.partial" "$prefix" && rm -f "$archive"
      step_ok ollama_install "Ollama $version installed from its pinned release"
    fi
    binary="$prefix/bin/ollama"
  else
    binary="$(command -v ollama || true)"
    [[ -n "$binary" ]] ||
      step_fail ollama_install "Ollama is not installed and provisioning.ollama_sha256 is not set to install release $version"
    # Port 1 refuses: the binary reports its own version, not that of an Ollama already serving on the host.
    have="$(OLLAMA_HOST=127.0.0.1:1 timeout 30 "$binary" --version 2>&1 | sed -n 's/^.*client version is //p' | head -n1)"
    [[ "$have" == "$version" ]] ||
      step_fail ollama_install "the installed $binary is version ${have:-unknown}, not the pinned $version (provisioning.ollama_version; set provisioning.ollama_sha256 to install the pinned release)"
    step_ok ollama_install "Ollama $version found installed at $binary"
  fi
  printf '%s' "$binary" >"$STATE_DIR/ollama-binary"
else
  step_start llamacpp_install
  variant=cuda
  [[ "$PROFILE" == cpu ]] && variant=cpu
  version="${QIIPNODE_LLAMACPP_VERSION:?}"
  sha="${QIIPNODE_LLAMACPP_SHA256:?}"
  prefix="$ROOT/opt/llama.cpp/$version-$variant"
  if [[ -x "$prefix/bin/llama-server" && "$(cat "$prefix/.qiip-source-sha256" 2>/dev/null)" == "$sha" ]]; then
    step_ok llamacpp_install "llama.cpp $version ($variant) already installed"
  else
    archive="${QIIPNODE_LLAMACPP_ARCHIVE:-}"
    [[ -f "$archive" ]] || step_fail llamacpp_install "llama.cpp is not installed and no source archive was uploaded"
    got="$(sha256sum "$archive" | cut -d' ' -f1)"
    [[ "$got" == "$sha" ]] || step_fail llamacpp_install "the source archive's sha256 is $got, not the pinned $sha"
    build="$STATE_DIR/llama.cpp-build"
    rm -rf "$build" && mkdir -p "$build"
    tar -xzf "$archive" -C "$build" || step_fail llamacpp_install "cannot extract $archive"
    src="$(dirname "$(find "$build" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n1)")"
    [[ -d "$src" ]] || src="$(find "$build" -mindepth 1 -maxdepth 1 -type d | head -n1)"
    cuda=ON
    [[ "$variant" == cpu ]] && cuda=OFF
    cmake -S "$src" -B "$build/out" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="$cuda" -DGGML_NATIVE=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF || step_fail llamacpp_install "cmake configure failed"
    cmake --build "$build/out" -j "$(nproc)" --target llama-server llama-fit-params ||
      step_fail llamacpp_install "the build failed"
    mkdir -p "$prefix/bin"
    cp "$build/out/bin/llama-server" "$build/out/bin/llama-fit-params" "$prefix/bin/"
    printf '%s' "$sha" >"$prefix/.qiip-source-sha256"
    rm -rf "$build"
    step_ok llamacpp_install "llama.cpp $version ($variant) built"
  fi
  if [[ "$variant" == cuda ]] && ! grep -aq 'ggml_cuda' "$prefix/bin/llama-server"; then
    step_fail llamacpp_install "the installed llama-server has no CUDA backend; a GPU host never serves on its CPU"
  fi
fi

step_start nfs_mount
mount_point="$ROOT${QIIPNODE_MODEL_DIR:-/srv/hf-cache}"
if [[ -z "${QIIPNODE_NFS_EXPORT:-}" ]]; then
  mkdir -p "$mount_point"
  step_warn nfs_mount "no shared model cache is configured; models are read from $mount_point as it is"
elif mountpoint -q "$mount_point"; then
  step_ok nfs_mount "$mount_point already mounted"
else
  mkdir -p "$mount_point"
  mount -t nfs -o vers=3,soft,timeo=100,retrans=2 "$QIIPNODE_NFS_EXPORT" "$mount_point" ||
    step_fail nfs_mount "cannot mount $QIIPNODE_NFS_EXPORT at $mount_point"
  step_ok nfs_mount "$QIIPNODE_NFS_EXPORT mounted at $mount_point"
fi

step_start firewall
port="${QIIPNODE_ENGINE_PORT:?}"
if command -v firewall-cmd >/dev/null 2>&1 && firewall-cmd --state >/dev/null 2>&1; then
  firewall-cmd --query-port="$port/tcp" >/dev/null 2>&1 ||
    { firewall-cmd --permanent --add-port="$port/tcp" && firewall-cmd --reload; } ||
    step_fail firewall "firewall-cmd could not open port $port/tcp"
  step_ok firewall "port $port/tcp open (firewalld)"
elif command -v iptables >/dev/null 2>&1; then
  iptables -C INPUT -p tcp --dport "$port" -j ACCEPT 2>/dev/null ||
    iptables -I INPUT -p tcp --dport "$port" -j ACCEPT || step_fail firewall "iptables could not open port $port"
  step_ok firewall "port $port/tcp open (iptables)"
else
  step_warn firewall "neither firewalld nor iptables is present; port $port is not filtered"
fi
exit 0
