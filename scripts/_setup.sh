#!/usr/bin/env bash
# Prepare and activate the project's virtual environment (.venv in the repo root).
#
# Sourced by the other scripts (`source scripts/_setup.sh`); after it returns, the
# current directory is the repo root and `python`, `pytest` and `ruff` are the venv's.
#
# CPU machine:  an isolated venv; torch==2.13.0 is installed explicitly first (the
#               local CPU wheel), then this package editable with the dev and lab extras
#               (pytest, ruff; matplotlib, tqdm for `python -m minifloat compare`).
#               A dry run checks beforehand that nothing CUDA-only (nvidia-*, triton)
#               would be downloaded.
# CUDA machine: a venv with --system-site-packages that also sees the site-packages
#               of the host `python3` (which may itself be a venv), so the preinstalled
#               torch/triton/pytest are reused; the package is installed with
#               --no-deps --no-build-isolation and no index, and anything still missing
#               (numpy, pytest, ruff, matplotlib, tqdm) is tried once with a short timeout,
#               never failing hard when offline (compare then skips its PNG / progress bar).
#
# A stamp file inside the venv holds a hash of pyproject.toml and this script; while it
# matches, nothing is installed and sourcing takes well under a second.
#
# Knobs (environment):
#   MINIFLOAT_DEVICE=cpu|cuda   skip detection and use this mode
#   MINIFLOAT_PYTHON=python3    interpreter the venv is made from
#   MINIFLOAT_TORCH_SPEC        torch requirement on CPU machines (default torch==2.13.0)
#   MINIFLOAT_ALLOW_CUDA_TORCH=1  let a CPU install pull CUDA packages anyway
#   MINIFLOAT_FORCE_SETUP=1     reinstall even if the stamp matches

# Strict mode when run directly; when sourced, the calling script has already set it
# (and an interactive shell that sources this to activate the venv is left alone).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
fi

_mf_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$_mf_root"

_mf_venv="$_mf_root/.venv"
_mf_stamp="$_mf_venv/.minifloat-setup-stamp"
_mf_log="$_mf_venv/.minifloat-setup.log"

_mf_say() { printf '[setup] %s\n' "$*" >&2; }

_mf_hash() {
    # Anything that should trigger a reinstall when it changes.
    {
        cat "$_mf_root/pyproject.toml" "$_mf_root/scripts/_setup.sh"
        # A package directory appearing later must re-run the editable install.
        ls -1 "$_mf_root/src" 2>/dev/null || true
        [[ -f "$_mf_root/src/minifloat/__init__.py" ]] && echo "minifloat/__init__.py"
        true
    } | if command -v sha256sum >/dev/null 2>&1; then
        sha256sum | cut -d' ' -f1
    else
        cksum | cut -d' ' -f1
    fi
}

_mf_activate() {
    # Same effect as bin/activate, without its prompt handling (safe under set -u).
    export VIRTUAL_ENV="$_mf_venv"
    case ":$PATH:" in
        *":$_mf_venv/bin:"*) ;;
        *) export PATH="$_mf_venv/bin:$PATH" ;;
    esac
    unset PYTHONHOME
    hash -r 2>/dev/null || true
}

_mf_fail() {
    _mf_say "ERROR: $*"
    if [[ -f "$_mf_log" ]]; then
        _mf_say "last lines of $_mf_log:"
        tail -n 40 "$_mf_log" >&2 || true
    fi
    return 1
}

_mf_pip() {
    # pip inside the venv, output to the log; never prompts.
    PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$_mf_venv/bin/python" -m pip "$@" >>"$_mf_log" 2>&1
}

_mf_detect_mode() {
    if [[ -n "${MINIFLOAT_DEVICE:-}" ]]; then
        case "$MINIFLOAT_DEVICE" in
            cpu|cuda) echo "$MINIFLOAT_DEVICE"; return 0 ;;
            *) _mf_say "MINIFLOAT_DEVICE must be cpu or cuda (got '$MINIFLOAT_DEVICE')"; return 1 ;;
        esac
    fi
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo cuda; return 0
    fi
    # No nvidia-smi: ask the host interpreter's torch, but only import it if it exists.
    if "$_mf_host_py" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' \
            >/dev/null 2>&1 \
        && "$_mf_host_py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
            >/dev/null 2>&1; then
        echo cuda; return 0
    fi
    echo cpu
}

# Refuse (before downloading anything) a CPU install that would bring CUDA packages.
_mf_guard_no_cuda() {
    [[ "${MINIFLOAT_ALLOW_CUDA_TORCH:-0}" == 1 ]] && return 0
    local report
    report="$_mf_venv/.minifloat-dry-run.json"
    if ! _mf_pip install --dry-run --quiet --report "$report" "$@"; then
        _mf_fail "dry run of 'pip install $*' failed"
        return 1
    fi
    local bad
    bad="$("$_mf_venv/bin/python" - "$report" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    report = json.load(f)
bad = []
for item in report.get("install", []):
    meta = item.get("metadata", {})
    name = meta.get("name", "").lower()
    version = meta.get("version", "")
    if name.startswith(("nvidia-", "triton", "cuda-")) or (name == "torch" and "+cu" in version):
        bad.append(f"{name}=={version}")
print(" ".join(bad))
PY
)" || { _mf_fail "could not read the pip dry-run report"; return 1; }
    rm -f "$report"
    if [[ -n "$bad" ]]; then
        _mf_fail "on this CPU machine 'pip install $*' would download CUDA packages: $bad." \
            "Refusing. (Set MINIFLOAT_TORCH_SPEC to a CPU torch wheel, or" \
            "MINIFLOAT_ALLOW_CUDA_TORCH=1 to allow it.)"
        return 1
    fi
}

_mf_install_cpu() {
    local torch_spec="${MINIFLOAT_TORCH_SPEC:-torch==2.13.0}"
    local -a links=()
    # The machine's local wheel folder (also in its pip config); harmless where absent.
    if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
        links=(--find-links /opt/wheels)
    fi
    _mf_say "installing build tools (setuptools, wheel)"
    _mf_pip install "setuptools>=68" wheel \
        || { _mf_fail "could not install setuptools/wheel"; return 1; }
    _mf_say "installing $torch_spec (CPU)"
    _mf_guard_no_cuda "${links[@]}" "$torch_spec" || return 1
    _mf_pip install "${links[@]}" "$torch_spec" \
        || { _mf_fail "could not install $torch_spec"; return 1; }
    _mf_say "installing minifloat (editable) with dev and lab extras"
    _mf_guard_no_cuda "${links[@]}" --no-build-isolation -e ".[dev,lab]" || return 1
    _mf_pip install "${links[@]}" --no-build-isolation -e ".[dev,lab]" \
        || { _mf_fail "could not install the package"; return 1; }
}

# Can the venv build an editable wheel offline (--no-build-isolation)?
_mf_setuptools_ok() {
    "$_mf_venv/bin/python" - >/dev/null 2>&1 <<'PY'
import sys
import setuptools
major = int(setuptools.__version__.split(".")[0])
if major < 68:
    sys.exit(1)
try:
    from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools>=70.1)
except ImportError:
    import wheel.bdist_wheel  # noqa: F401
PY
}

_mf_install_cuda() {
    # Let the venv see the host interpreter's site-packages even when that interpreter
    # is itself a venv (--system-site-packages only reaches the base installation).
    local own_site
    own_site="$("$_mf_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$_mf_host_py" - "$own_site" >"$own_site/zz_minifloat_host_site.pth" <<'PY'
import os, site, sys
own = os.path.realpath(sys.argv[1])
dirs = []
candidates = list(site.getsitepackages())
if site.ENABLE_USER_SITE:
    candidates.append(site.getusersitepackages())
candidates += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
for p in candidates:
    if p and os.path.isdir(p) and os.path.realpath(p) != own and p not in dirs:
        dirs.append(p)
for p in dirs:
    print(f"import site; site.addsitedir({p!r})")
PY
    if ! "$_mf_venv/bin/python" -m pip --version >/dev/null 2>&1; then
        # The host has no pip: take the one bundled with Python (offline).
        "$_mf_venv/bin/python" -m ensurepip --default-pip >>"$_mf_log" 2>&1 \
            || { _mf_fail "no pip in the host interpreter and ensurepip failed"; return 1; }
    fi

    if ! "$_mf_venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
        _mf_say "torch not found on this CUDA machine; trying 'pip install torch>=2.10'"
        _mf_pip install "torch>=2.10" || { _mf_fail "no torch and it could not be installed"; return 1; }
    fi
    if ! _mf_setuptools_ok; then
        # A venv-local setuptools (e.g. from ensurepip) may shadow a usable host one.
        if [[ -d "$own_site/setuptools" ]]; then
            _mf_pip uninstall -y setuptools || true
        fi
        if ! _mf_setuptools_ok; then
            _mf_say "setuptools>=68 with bdist_wheel not found; trying to install it"
            _mf_pip install --retries 0 --timeout 15 "setuptools>=68" wheel \
                || { _mf_fail "setuptools>=68 is missing and could not be installed"; return 1; }
        fi
    fi

    _mf_say "installing minifloat (editable, --no-deps, offline)"
    PIP_NO_INDEX=1 _mf_pip install --no-deps --no-build-isolation -e . \
        || { _mf_fail "could not install the package"; return 1; }

    # Fill in what is missing, pinned as in pyproject.toml; tolerate having no network.
    local spec mod
    while read -r mod spec; do
        [[ -z "$mod" ]] && continue
        if ! "$_mf_venv/bin/python" -c "import $mod" >/dev/null 2>&1; then
            _mf_say "$mod missing; trying 'pip install $spec'"
            _mf_pip install --retries 0 --timeout 15 "$spec" \
                || _mf_say "WARNING: could not install $spec (offline?); continuing"
        fi
    done < <("$_mf_venv/bin/python" - "$_mf_root/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def spec(name, default):
    m = re.search(r'"(%s\s*[=<>!~][^"]*)"' % re.escape(name), text)
    return m.group(1).replace(" ", "") if m else default
print("numpy", spec("numpy", "numpy"))
print("pytest", spec("pytest", "pytest"))
print("ruff", spec("ruff", "ruff"))
print("matplotlib", spec("matplotlib", "matplotlib"))
print("tqdm", spec("tqdm", "tqdm"))
PY
)
    "$_mf_venv/bin/python" -c 'import pytest' >/dev/null 2>&1 \
        || _mf_say "WARNING: pytest is not available; scripts/test and scripts/gpu-check will fail"
}

_mf_setup() {
    local want have="" have_mode=""
    want="$(_mf_hash)"
    if [[ -f "$_mf_stamp" ]]; then
        read -r have have_mode <"$_mf_stamp" || true
    fi

    # Fast path: venv works and the stamp matches.
    if [[ "${MINIFLOAT_FORCE_SETUP:-0}" != 1 && "$have" == "$want" \
          && ( -z "${MINIFLOAT_DEVICE:-}" || "${MINIFLOAT_DEVICE}" == "$have_mode" ) ]] \
        && "$_mf_venv/bin/python" -c '' >/dev/null 2>&1; then
        _mf_activate
        return 0
    fi

    _mf_host_py="${MINIFLOAT_PYTHON:-python3}"
    if ! command -v "$_mf_host_py" >/dev/null 2>&1; then
        _mf_say "ERROR: '$_mf_host_py' not found"; return 1
    fi
    if ! "$_mf_host_py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
        _mf_say "ERROR: Python >= 3.10 is needed ($_mf_host_py is $("$_mf_host_py" -V 2>&1))"
        return 1
    fi

    local mode
    mode="$(_mf_detect_mode)" || return 1
    _mf_say "setting up .venv for a $mode machine (first run or pyproject.toml changed)"

    # Recreate the venv when it is broken or was made for the other mode.
    if [[ -d "$_mf_venv" ]] && { ! "$_mf_venv/bin/python" -c '' >/dev/null 2>&1 \
            || [[ -n "$have_mode" && "$have_mode" != "$mode" ]]; }; then
        _mf_say "removing the old .venv (broken or made for '${have_mode:-?}')"
        rm -rf "$_mf_venv"
    fi
    if [[ ! -x "$_mf_venv/bin/python" ]]; then
        # On CUDA machines the venv gets no pip/setuptools of its own: the host's are used
        # (through the site-packages added in _mf_install_cuda), so an old bundled
        # setuptools cannot shadow the host's and nothing has to be fetched.
        local -a venv_opts=()
        [[ "$mode" == cuda ]] && venv_opts=(--system-site-packages --without-pip)
        "$_mf_host_py" -m venv "${venv_opts[@]}" "$_mf_venv" \
            || { _mf_say "ERROR: could not create .venv"; return 1; }
    fi
    rm -f "$_mf_stamp"
    : >"$_mf_log"

    if [[ "$mode" == cuda ]]; then
        _mf_install_cuda || return 1
    else
        _mf_install_cpu || return 1
    fi

    "$_mf_venv/bin/python" -c 'import torch' >/dev/null 2>&1 \
        || { _mf_fail "torch does not import in .venv"; return 1; }
    "$_mf_venv/bin/python" - >&2 <<'PY' || true
import torch
try:
    import numpy
    np_version = numpy.__version__
except ImportError:
    np_version = "missing"
print(f"[setup] torch {torch.__version__} (cuda {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}), numpy {np_version}")
PY
    echo "$want $mode" >"$_mf_stamp"
    _mf_activate
    _mf_say "done (log: .venv/$(basename "$_mf_log"))"
}

_mf_setup || return 1 2>/dev/null || exit 1
