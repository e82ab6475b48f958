#!/usr/bin/env bash
# Installs what lintape needs to build on Debian/Ubuntu, with apt-get, and only what is missing: when
# everything is there it changes nothing and needs no root. CUDA is optional and never installed here;
# when nvcc is found the build adds the CUDA kernels (LINTAPE_CUDA=AUTO).
set -euo pipefail

missing=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

have_cmd cmake || missing+=(cmake)
have_cmd ninja || missing+=(ninja-build)
have_cmd g++ || missing+=(g++)
# OpenMPI: `mpirun -np N lintape train` (several ranks; without it every run is a single rank).
for pkg in libeigen3-dev doctest-dev libcli11-dev nlohmann-json3-dev libfmt-dev libopenmpi-dev openmpi-bin; do
  have_pkg "$pkg" || missing+=("$pkg")
done
# The default training corpus of `lintape train`: about 2.5 MB of English text in /usr/share/games/fortunes/.
have_pkg fortunes || missing+=(fortunes)

if ((${#missing[@]} == 0)); then
  echo "setup: all build dependencies are present"
else
  echo "setup: installing ${missing[*]}"
  if ! have_cmd apt-get; then
    echo "setup: apt-get not found (not Debian/Ubuntu?); install these yourself: ${missing[*]}" >&2
    exit 1
  fi
  as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! have_cmd sudo; then
      echo "setup: installing needs root, and sudo is not available; as root run: apt-get install ${missing[*]}" >&2
      exit 1
    fi
    as_root=(sudo)
  fi
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The distribution's CMake may be older than the project needs; apt cannot fix that.
cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
if ! printf '%s\n' 3.25 "$cmake_version" | sort -V -C; then
  echo "setup: CMake $cmake_version is too old; lintape needs 3.25 or newer (e.g. pip install cmake)" >&2
  exit 1
fi
