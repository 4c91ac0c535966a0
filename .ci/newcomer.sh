#!/usr/bin/env bash
# The newcomer matrix: the README's two commands, as a new user runs them, in the layouts a new user may have.
#
#   bash .ci/newcomer.sh --list          # the cells
#   bash .ci/newcomer.sh CELL...         # run those cells; no CELL runs every cell
#
# Each cell makes a fresh `git clone` of this checkout's HEAD (committed work only) and, unless it says otherwise, a
# fresh venv (`python -m venv`), then runs the README's commands in it:
#
#   pip install torch==2.13.0 && pip install -e '.[dev]' && python experiments/tiny_cpu.py --minutes M
#   python -m pytest -q tests
#
# The main job runs with a short budget (`--minutes`, NEWCOMER_MAIN_MINUTES, default 1) instead of the README's 10
# minutes: the matrix checks that it starts, trains and exits 0 in each layout, not its curve. Every cell prints its
# rc and wall time; a summary of all cells comes last, and the script exits non-zero if any cell failed.
#
# Knobs (environment):
#   NEWCOMER_WORK          scratch root (default: a fresh dir under /tmp); left in place for the logs
#   NEWCOMER_MAIN_MINUTES  the main job's budget in minutes (default 1); 0 skips the main job
#   NEWCOMER_SUITE         full (default: the README's test command) or collect (`--collect-only`: a smoke of the
#                          install, for a busy machine)
#   NEWCOMER_PYTHON        interpreter of the cells that reuse an installed environment (explore-*, order-*);
#                          default: python3 on PATH
#
# Cells:
#   tmp-venv        the venv under /tmp (NEWCOMER_WORK), Python 3.11
#   space-path      checkout and venv in a path containing a space
#   non-root        a throwaway user (useradd), Debian's /usr/bin/python3 (pyenv's live under /root, mode 0700)
#   py310 py311 py312  pyenv's 3.10.13 / 3.11.7 / 3.12.1 (torch 2.13.0's CPU wheel lies on disk for 3.11 only; for
#                   3.10 and 3.12 pip takes PyPI's CUDA build, several GB, which runs on the CPU too)
#   explore-1 explore-2 explore-3  HYPOTHESIS_PROFILE=explore on the property tests with a random --hypothesis-seed
#                   (printed, to replay a failure), in NEWCOMER_PYTHON's environment
#   order-fixed     the suite with `-p no:randomly` (file order), NEWCOMER_PYTHON's environment
#   order-random    the suite in random order (pytest-randomly, installed into a venv over NEWCOMER_PYTHON's packages;
#                   its seed is printed)
#   loaded          tmp-venv's layout with a CPU-bound loop on one core during the install, the main job and the suite
set -uo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH  # a developer's PYTHONPATH=<checkout> would test the checkout, not the fresh clone
main_minutes="${NEWCOMER_MAIN_MINUTES:-1}"
suite="${NEWCOMER_SUITE:-full}"
base_python="${NEWCOMER_PYTHON:-python3}"
pyenv_root="${PYENV_ROOT:-/root/.pyenv}"
# the property tests: pure leaves (objectives, advantages, data, ops, rewards) drawn by hypothesis strategies
property_tests=(tests/objectives tests/advantages tests/data tests/test_ops.py tests/test_leaves.py
                tests/test_leaf_dtypes.py tests/test_diagnostics.py tests/rollout/rewards/test_countdown.py
                tests/rollout/rewards/test_math.py)
all_cells=(tmp-venv space-path non-root py310 py311 py312 explore-1 explore-2 explore-3 order-fixed order-random loaded)

if [[ "${1:-}" == "--list" || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '/^# Cells:/,/^set -uo/p' "$0" | sed '$d'
  exit 0
fi
cells=("$@")
[[ ${#cells[@]} -eq 0 ]] && cells=("${all_cells[@]}")
for c in "${cells[@]}"; do
  if [[ ! " ${all_cells[*]} " == *" $c "* ]]; then
    echo "newcomer: unknown cell '$c'; the cells are: ${all_cells[*]} (see --list)" >&2
    exit 2
  fi
done

work="${NEWCOMER_WORK:-$(mktemp -d /tmp/rlcore-newcomer.XXXXXX)}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
echo "newcomer: cells ${cells[*]}; work dir $work; main job --minutes $main_minutes; suite: $suite"
echo "newcomer: testing $(git -C "$here" rev-parse --short HEAD) ($(git -C "$here" log -1 --format=%s | cut -c1-80))"

suite_cmd() {  # the README's test command (or its collect-only smoke), extra pytest args appended
  if [[ "$suite" == "collect" ]]; then
    echo "python -m pytest -q tests --collect-only $*"
  else
    echo "python -m pytest -q tests $*"
  fi
}

readme_in() {  # readme_in PYTHON DEST: fresh clone at DEST, fresh venv DEST/../venv from PYTHON, the README's commands
  local py="$1" dest="$2" venv
  venv="$(dirname "$dest")/venv"
  git clone -q "$here" "$dest" || return 1
  "$py" -m venv "$venv" || return 1
  # shellcheck disable=SC1091
  (
    source "$venv/bin/activate" && cd "$dest" || exit 1
    echo "+ pip install torch==2.13.0 && pip install -e '.[dev]'"
    pip install -q torch==2.13.0 && pip install -q -e '.[dev]' || exit 1
    if [[ "$main_minutes" != "0" ]]; then
      echo "+ python experiments/tiny_cpu.py --minutes $main_minutes"
      python experiments/tiny_cpu.py --minutes "$main_minutes" > "$dest/../main_job.log" 2>&1 \
        || { tail -20 "$dest/../main_job.log"; exit 1; }
      tail -3 "$dest/../main_job.log"
    fi
    suite_with python
  )
}

cell_tmp_venv() { readme_in "$pyenv_root/versions/3.11.7/bin/python" "$work/tmp-venv/rlcore"; }

cell_space_path() { readme_in "$pyenv_root/versions/3.11.7/bin/python" "$work/space path/rl core"; }

cell_pyver() {  # cell_pyver VERSION
  local py="$pyenv_root/versions/$1/bin/python"
  [[ -x "$py" ]] || { echo "no interpreter at $py"; return 1; }
  readme_in "$py" "$work/py$1/rlcore"
}

cell_non_root() {
  local user="rlnewcomer$$" home rc
  [[ "$(id -u)" == 0 ]] || { echo "non-root: already not root ($(id -un)): run as root to create the user"; return 1; }
  home="$work/home-$user"
  useradd --create-home --home-dir "$home" --shell /bin/bash "$user" || return 1
  chmod 755 "$work"
  git clone -q "$here" "$home/rlcore" && chown -R "$user:" "$home/rlcore"
  local script="$home/run.sh"
  {
    echo "set -eo pipefail; cd ~/rlcore; /usr/bin/python3 -m venv ~/venv; source ~/venv/bin/activate"
    echo "echo \"+ as \$(id -un) (uid \$(id -u)); pip install torch==2.13.0 && pip install -e '.[dev]'\""
    echo "pip install -q torch==2.13.0 && pip install -q -e '.[dev]'"
    if [[ "$main_minutes" != "0" ]]; then
      echo "echo '+ python experiments/tiny_cpu.py --minutes $main_minutes'"
      echo "python experiments/tiny_cpu.py --minutes $main_minutes > ~/main_job.log 2>&1 || { tail -20 ~/main_job.log; exit 1; }"
      echo "tail -3 ~/main_job.log"
    fi
    echo "echo '+ $(suite_cmd)'; $(suite_cmd)"
  } > "$script"
  chown "$user:" "$script"
  runuser -u "$user" -- env -i HOME="$home" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    PIP_FIND_LINKS="${PIP_FIND_LINKS:-}" PIP_DISABLE_PIP_VERSION_CHECK=1 bash "$script"
  rc=$?
  ps -o pid= -u "$user" | xargs -r kill -KILL 2>/dev/null  # the throwaway user's processes, if any outlived the run
  userdel "$user" 2>/dev/null
  return $rc
}

cell_explore() {
  local seed=$(( (RANDOM << 15) | RANDOM )) dest="$work/$1/rlcore"
  git clone -q "$here" "$dest" && cd "$dest" || return 1
  echo "+ HYPOTHESIS_PROFILE=explore $base_python -m pytest -q ${property_tests[*]} --hypothesis-seed=$seed"
  HYPOTHESIS_PROFILE=explore "$base_python" -m pytest -q "${property_tests[@]}" "--hypothesis-seed=$seed" -p no:randomly
}

suite_with() {  # suite_with PYTHON [PYTEST ARGS]: the README's test command (or its smoke) with that interpreter
  local py="$1"
  shift
  local extra=()
  [[ "$suite" == "collect" ]] && extra=(--collect-only)
  echo "+ $py -m pytest -q tests ${extra[*]} $*"
  "$py" -m pytest -q tests "${extra[@]}" "$@"
}

cell_order_fixed() {
  local dest="$work/order-fixed/rlcore"
  git clone -q "$here" "$dest" && cd "$dest" || return 1
  suite_with "$base_python" -p no:randomly
}

cell_order_random() {
  local dest="$work/order-random/rlcore" venv="$work/order-random/venv" seed=$(( (RANDOM << 15) | RANDOM ))
  git clone -q "$here" "$dest" || return 1
  "$base_python" -m venv --system-site-packages "$venv" || return 1
  "$venv/bin/python" -m pip install -q pytest-randomly || { echo "pytest-randomly is not installable here"; return 1; }
  cd "$dest" || return 1
  suite_with "$venv/bin/python" -p randomly "--randomly-seed=$seed"
}

cell_loaded() {
  local py="$pyenv_root/versions/3.11.7/bin/python" hog rc
  taskset -c 0 "$py" -c "while True: pass" &
  hog=$!
  echo "+ a CPU-bound loop on core 0 (pid $hog) during the whole cell"
  readme_in "$py" "$work/loaded/rlcore"
  rc=$?
  kill "$hog" 2>/dev/null
  wait "$hog" 2>/dev/null
  return $rc
}

run_cell() {
  case "$1" in
    tmp-venv) cell_tmp_venv ;;
    space-path) cell_space_path ;;
    non-root) cell_non_root ;;
    py310) cell_pyver 3.10.13 ;;
    py311) cell_pyver 3.11.7 ;;
    py312) cell_pyver 3.12.1 ;;
    explore-1 | explore-2 | explore-3) cell_explore "$1" ;;
    order-fixed) cell_order_fixed ;;
    order-random) cell_order_random ;;
    loaded) cell_loaded ;;
  esac
}

summary=()
failed=0
for c in "${cells[@]}"; do
  echo
  echo "=== newcomer cell $c ($(date -u +%H:%M:%S) UTC)"
  t0=$(date +%s)
  ( run_cell "$c" ) 2>&1 | tee "$work/$c.log"
  rc=${PIPESTATUS[0]}
  wall=$(( $(date +%s) - t0 ))
  tail_line="$(grep -E '(passed|failed|error|tests collected|no tests ran)' "$work/$c.log" | tail -1 | cut -c1-100)"
  echo "=== newcomer cell $c: rc $rc, wall ${wall} s${tail_line:+ — $tail_line}"
  summary+=("$(printf '%-13s rc %-3s %6s s   %s' "$c" "$rc" "$wall" "$tail_line")")
  [[ $rc -ne 0 ]] && failed=$((failed + 1))
done

echo
echo "=== newcomer matrix summary ($(git -C "$here" rev-parse --short HEAD), suite: $suite, main job --minutes $main_minutes; logs in $work)"
printf '%s\n' "${summary[@]}"
[[ $failed -eq 0 ]]
