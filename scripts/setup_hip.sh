#!/usr/bin/env bash
# Set up the HIP toolchain prefix that TileLang accepts as ROCM_PATH, on a Debian 12 machine
# without an AMD GPU (no ROCm install), for compile-only builds of gfx942 (MI300X) and gfx950
# (MI355X). See docs/hip.md.
#
#   bash scripts/setup_hip.sh          # prefix at ./.rocm (override: DSV4_TL_ROCM_PREFIX=path)
#   eval "$(bash scripts/setup_hip.sh)"   # same, and export ROCM_PATH in this shell
#
# What it does:
#   1. apt-get installs clang-22, lld-22 and llvm-22 (llvm-readelf-22 / llvm-objdump-22 for the
#      code-object checks) from Debian bookworm-security (needs root or sudo).
#   2. Downloads the HIP headers (libamdhip64-dev) and the AMDGCN device bitcode
#      (rocm-device-libs-NN) with apt into a PRIVATE apt state directory (the system's apt
#      sources and status are not touched) and unpacks them with dpkg-deb -x; nothing is
#      installed. Pinned: HIP 7.2.4 + rocm-device-libs-22 from Debian experimental; if those
#      versions have left the archive: HIP 6.4.3 + rocm-device-libs-21 from sid (built with
#      -D__AMDGCN_WAVEFRONT_SIZE=64, which the 6.4 headers need under clang 22).
#   3. Lays out <prefix>: include/hip, share/hip/version, amdgcn/bitcode,
#      include/rocwmma/rocwmma.hpp (a stand-in: TileLang includes rocWMMA only for the bf16/fp16
#      types) and bin/hipcc, a wrapper running clang-22 -x hip that turns TileLang's --genco
#      into --cuda-device-only --no-gpu-bundle-output.
#
# Idempotent: a second run only checks the stamp file and the tools (well under a second).
# DSV4_TL_HIP_FORCE=1 rebuilds the prefix; DSV4_TL_HIP_FALLBACK=1 uses the sid fallback pins.
# Code objects are v5 (ROCm >= 5.x runtimes load them); DSV4_TL_HIP_COV=6 selects v6.
# The last line printed (stdout) is: export ROCM_PATH=<prefix>
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PREFIX="${DSV4_TL_ROCM_PREFIX:-$PWD/.rocm}"
LLVM=22
COV="${DSV4_TL_HIP_COV:-5}"
# Pins: "<suite> <package> <version>". Primary, then fallback.
HIP_PIN=("experimental libamdhip64-dev 7.2.4-1~exp2" "sid libamdhip64-dev 6.4.3-5")
DEVLIBS_PIN=("experimental rocm-device-libs-22 7.2.4+dfsg-1~exp1" "sid rocm-device-libs-21 7.0.2+dfsg-3")
SCRIPT_REV=1  # bump when the prefix layout changes

log() { echo "setup_hip: $*" >&2; }
start=$SECONDS

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

tools_ok() {
    command -v "clang-$LLVM" >/dev/null && command -v "ld.lld-$LLVM" >/dev/null \
        && command -v "llvm-readelf-$LLVM" >/dev/null && command -v "llvm-objdump-$LLVM" >/dev/null
}

stamp="$PREFIX/.dsv4_tl_setup"
want_stamp_prefix="rev=$SCRIPT_REV cov=$COV fallback=${DSV4_TL_HIP_FALLBACK:-0}"
if [ "${DSV4_TL_HIP_FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ -x "$PREFIX/bin/hipcc" ] \
        && grep -qF "$want_stamp_prefix" "$stamp" && tools_ok; then
    log "already set up ($(sed -n 1p "$stamp"))"
    echo "export ROCM_PATH=$PREFIX"
    exit 0
fi

# --- 1. clang-22, lld-22, llvm-22 from bookworm-security --------------------------------------
if ! tools_ok; then
    log "installing clang-$LLVM lld-$LLVM llvm-$LLVM (apt)"
    export DEBIAN_FRONTEND=noninteractive
    if ! as_root apt-get install -y -q --no-install-recommends "clang-$LLVM" "lld-$LLVM" "llvm-$LLVM" >&2; then
        as_root apt-get update -q >&2
        as_root apt-get install -y -q --no-install-recommends "clang-$LLVM" "lld-$LLVM" "llvm-$LLVM" >&2
    fi
    tools_ok || { log "clang-$LLVM / lld-$LLVM / llvm-$LLVM tools missing after apt-get install"; exit 1; }
fi

# --- 2. HIP headers + device bitcode through a private apt state -------------------------------
# The Debian mirror of this machine (deb822 sources first, then the one-line format).
mirror=$(sed -n 's/^URIs:[[:space:]]*\(\S*\/debian\)\/\?[[:space:]]*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 || true)
[ -n "$mirror" ] || mirror=$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\(\S*\/debian\)\/\?[[:space:]].*/\2/p' \
    /etc/apt/sources.list 2>/dev/null | head -n1 || true)
mirror="${mirror:-http://deb.debian.org/debian}"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

work=$(mktemp -d "${TMPDIR:-/tmp}/dsv4_hip_apt.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/root"
: > "$work/status"
APT_OPTS=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o "Dir::State::status=$work/status" -o "APT::Sandbox::User=root" -q)
updated_suites=""
private_update() {  # $1: suite; adds it to the private sources and refreshes the lists
    case " $updated_suites " in *" $1 "*) return 0 ;; esac
    echo "deb [signed-by=$keyring] $mirror $1 main" >> "$work/sources.list"
    apt-get "${APT_OPTS[@]}" update >&2
    updated_suites="$updated_suites $1"
}
fetch_pinned() {  # $1: pin index -> downloads HIP and device libs of that pin into $work/debs
    local hip=(${HIP_PIN[$1]}) dl=(${DEVLIBS_PIN[$1]})
    private_update "${hip[0]}"
    private_update "${dl[0]}"
    (cd "$work/debs" && apt-get "${APT_OPTS[@]}" download \
        "${hip[1]}=${hip[2]}" "${dl[1]}=${dl[2]}" >&2)
}
pin=0
[ "${DSV4_TL_HIP_FALLBACK:-0}" = 1 ] && pin=1
if ! fetch_pinned "$pin"; then
    [ "$pin" = 1 ] && { log "could not download the fallback pins either"; exit 1; }
    log "pinned ${HIP_PIN[0]} / ${DEVLIBS_PIN[0]} not downloadable; falling back to ${HIP_PIN[1]} / ${DEVLIBS_PIN[1]}"
    rm -f "$work"/debs/*.deb
    pin=1
    fetch_pinned 1
fi
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
hip_ver=$(cut -d' ' -f3 <<<"${HIP_PIN[$pin]}")
dl_pkg=$(cut -d' ' -f2 <<<"${DEVLIBS_PIN[$pin]}")
dl_ver=$(cut -d' ' -f3 <<<"${DEVLIBS_PIN[$pin]}")
dl_llvm=${dl_pkg##*-}
bitcode="$work/root/usr/lib/llvm-$dl_llvm/lib/clang/$dl_llvm/amdgcn/bitcode"
[ -f "$work/root/usr/include/hip/hip_runtime.h" ] || { log "no hip_runtime.h in libamdhip64-dev"; exit 1; }
[ -f "$work/root/usr/share/hip/version" ] || { log "no share/hip/version in libamdhip64-dev"; exit 1; }
[ -d "$bitcode" ] || { log "no amdgcn bitcode in $dl_pkg"; exit 1; }

# --- 3. the prefix ------------------------------------------------------------------------------
new="$PREFIX.new.$$"
rm -rf "$new"
mkdir -p "$new/include" "$new/share" "$new/amdgcn" "$new/bin" "$new/include/rocwmma"
cp -a "$work/root/usr/include/hip" "$new/include/hip"
cp -a "$work/root/usr/share/hip" "$new/share/hip"
cp -a "$bitcode" "$new/amdgcn/bitcode"
cat > "$new/include/rocwmma/rocwmma.hpp" <<'EOF'
// Stand-in written by scripts/setup_hip.sh: TileLang's HIP templates include rocWMMA only for
// the hip_bfloat16 / half types; no rocWMMA API is used by the generated kernels.
#pragma once
#include <hip/hip_bfloat16.h>
#include <hip/hip_fp16.h>
EOF
extra="-mcode-object-version=$COV"
case "$hip_ver" in 6.*) extra="$extra -D__AMDGCN_WAVEFRONT_SIZE=64" ;; esac
clang_bin=$(command -v "clang-$LLVM")
cat > "$new/bin/hipcc" <<EOF
#!/usr/bin/env bash
# hipcc stand-in written by scripts/setup_hip.sh: clang-$LLVM in HIP mode with this prefix's
# headers and device libraries. TileLang calls "hipcc ... --offload-arch=gfxNNN --genco -o x.hsaco";
# --genco becomes --cuda-device-only --no-gpu-bundle-output (a bare code object, no bundle).
prefix="\$(cd "\$(dirname "\$(readlink -f "\${BASH_SOURCE[0]}")")/.." && pwd)"
args=()
for a in "\$@"; do
    case "\$a" in
        --genco) args+=(--cuda-device-only --no-gpu-bundle-output) ;;
        *) args+=("\$a") ;;
    esac
done
exec $clang_bin -x hip --rocm-path="\$prefix" --rocm-device-lib-path="\$prefix/amdgcn/bitcode" \\
    -isystem "\$prefix/include" $extra "\${args[@]}"
EOF
chmod +x "$new/bin/hipcc"
{
    echo "HIP $hip_ver (${HIP_PIN[$pin]%% *}), $dl_pkg $dl_ver (${DEVLIBS_PIN[$pin]%% *}), $("$clang_bin" --version | head -n1)"
    echo "$want_stamp_prefix"
    echo "flags: $extra"
} > "$new/.dsv4_tl_setup"
mkdir -p "$new/share/dsv4_tl" && cp "$work"/debs/*.deb "$new/share/dsv4_tl/"  # provenance (~0.7 MB)

# Smoke test: one device-only compile for each arch, before the prefix replaces the old one.
cat > "$work/smoke.cc" <<'EOF'
#include <hip/hip_runtime.h>
#include <hip/hip_bf16.h>
#include <rocwmma/rocwmma.hpp>
extern "C" __global__ void smoke(float *x) { x[threadIdx.x] = roundf(x[threadIdx.x]) + warpSize; }
EOF
for arch in gfx942 gfx950; do
    "$new/bin/hipcc" -O3 -c --offload-arch=$arch --genco -std=c++17 -o "$work/smoke.$arch.hsaco" "$work/smoke.cc" >&2 \
        || { log "smoke compile for $arch failed"; exit 1; }
    "llvm-readelf-$LLVM" -h "$work/smoke.$arch.hsaco" > "$work/smoke.$arch.txt"  # no pipe: grep -q + pipefail races
    grep -q "EM_AMDGPU" "$work/smoke.$arch.txt" && grep -qi "$arch" "$work/smoke.$arch.txt" \
        || { log "smoke compile for $arch produced no $arch code object"; exit 1; }
done

rm -rf "$PREFIX.old.$$"
[ -e "$PREFIX" ] && mv "$PREFIX" "$PREFIX.old.$$"
mv "$new" "$PREFIX"
rm -rf "$PREFIX.old.$$"
log "$(sed -n 1p "$PREFIX/.dsv4_tl_setup")"
log "prefix $PREFIX ready in $((SECONDS - start)) s"
echo "export ROCM_PATH=$PREFIX"
