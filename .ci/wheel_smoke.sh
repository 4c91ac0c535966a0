#!/usr/bin/env bash
# The built wheel installs and works outside the checkout. Used by .ci/run and tests/test_wheel.py.
#
#   bash .ci/wheel_smoke.sh [SRC] [WORK]     # SRC: the source tree (default: this checkout); WORK: scratch dir
#
# Builds the wheel of SRC, installs it NON-editable into a fresh venv that sees the system site-packages (torch
# and friends are not downloaded again), and from WORK/away (outside SRC) checks: rlcore is imported from the
# venv, every non-Python file under SRC/rlcore and SRC/kernels was installed (package data), the tiny main-job
# model loads from the installed package and generates, its chat template renders, `python -m rlcore.serve
# --help` works, and the main job's smoke preset runs. The last line is "wheel smoke: ok" on success.
set -euo pipefail
src="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
work="${2:-$(mktemp -d)}"
mkdir -p "$work/dist" "$work/away"
work="$(cd "$work" && pwd)"
unset PYTHONPATH  # a developer's PYTHONPATH=<checkout> would hide a broken wheel
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "wheel smoke: building the wheel of $src"
python -m pip wheel -q --no-deps -w "$work/dist" "$src"
wheel=("$work"/dist/rlcore-*.whl)
echo "wheel smoke: installing ${wheel[0]##*/} into a fresh venv"
python -m venv --system-site-packages "$work/venv"
py="$work/venv/bin/python"
# --no-deps: the dependencies come from the system site-packages (checked importable below), not the network.
"$py" -m pip install -q --no-deps --no-index "${wheel[0]}"

cd "$work/away"  # nothing of the checkout on sys.path ('' is this directory)
"$py" - "$src" <<'PY'
import importlib.metadata as md
import re
import sys
from pathlib import Path

src = Path(sys.argv[1])
import rlcore
import rlcore_kernels.logp_entropy as kernels
from rlcore import tiny

pkg = Path(rlcore.__file__).resolve().parent
assert src not in pkg.parents and "site-packages" in pkg.parts, f"rlcore was imported from {pkg}, not the venv"
assert "site-packages" in Path(kernels.__file__).resolve().parts, kernels.__file__
for req in md.requires("rlcore") or []:
    if "extra ==" not in req:  # a declared dependency must be importable next to the wheel
        md.version(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
# package data: every non-Python file in the source packages was installed
for top, installed in (("rlcore", "rlcore"), ("kernels", "rlcore_kernels")):
    for f in (src / top).rglob("*"):
        if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts:
            dest = pkg.parent / installed / f.relative_to(src / top)
            assert dest.is_file(), f"{f.relative_to(src)} is not in the wheel: add it to [tool.setuptools.package-data]"
# the main job's tiny model: loads from the installed package, templates, generates
import torch
from transformers import AutoModelForCausalLM

asset = tiny.COUNTDOWN_TINY_DIR
assert asset.is_dir() and pkg in asset.resolve().parents, f"tiny asset {asset} not inside the installed package"
tok = tiny.load_tokenizer(asset)
model = AutoModelForCausalLM.from_pretrained(asset).eval()
prompt = "3579:42="
assert tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False) == prompt, "chat template"
ids = torch.tensor([tok(prompt)["input_ids"]])
out, logp, lengths = tiny.generate(model, ids, max_new_tokens=9, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
text = tiny.decode_rows(tok, out, lengths)[0]
assert set(text) <= set(tiny.COUNTDOWN_ALPHABET), text
print(f"wheel smoke: rlcore {md.version('rlcore')} from {pkg}; tiny model greedy {prompt!r} -> {text!r}")
PY
"$py" -m rlcore.serve --help > "$work/serve_help.txt"
grep -q -- "--model" "$work/serve_help.txt" || { cat "$work/serve_help.txt"; exit 1; }
echo "wheel smoke: python -m rlcore.serve --help ok"
# The main job's smoke preset (experiments/ is not in the wheel: run the checkout's script on the installed rlcore).
"$py" "$src/experiments/tiny_cpu.py" --minutes 0.2 --eval-prompts 64 > "$work/main_job.log" 2>&1 \
  || { tail -n 40 "$work/main_job.log"; exit 1; }
grep -q "greedy_success_end" "$work/main_job.log" || { tail -n 40 "$work/main_job.log"; exit 1; }
echo "wheel smoke: main job smoke preset ok ($(grep -o 'steps=[0-9]*' "$work/main_job.log" | head -1))"
echo "wheel smoke: ok"
