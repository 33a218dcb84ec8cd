#!/usr/bin/env bash
# Runs the tiny-model study (experiments/tiny/README.md) one run after another, then draws it.
#
#   experiments/tiny/run_study.sh [ROOT] [PART...]
#
# ROOT (default /tmp/tiny) receives ROOT/<env>/<run>/ workdirs; re-running resumes or skips
# finished runs. PARTs (default all): babyai textcraft horizon seeds.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="${1:-/tmp/tiny}"
shift || true
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(babyai textcraft horizon seeds)
python="${PYTHON:-python}"  # e.g. PYTHON=.venv/bin/python

train() {  # train ENV RUN CONFIG_ARGS [--config.x=y ...]
  local env="$1" run="$2" args="$3"
  shift 3
  echo "=== ${env}/${run}: ${args} $*"
  if ! "${python}" -m agentgym_jax.train --config="experiments/tiny/${env}.py:${args}" \
      --workdir="${root}/${env}/${run}" --config.log.progress_bar=False "$@" \
      > "${root}/${env}/${run}.log" 2>&1; then
    tail -5 "${root}/${env}/${run}.log" >&2
    exit 1
  fi
  grep -E "^(eval at|Held-out)" "${root}/${env}/${run}.log" || true  # none: already complete
}

evaluate() {  # evaluate ENV RUN NAME SPLIT [FLAG...]: RUN's checkpoint on SPLIT into RUN/NAME/
  local env="$1" run="$2" name="$3" split="$4"
  shift 4
  echo "=== ${env}/${run}: ${name} (${split} split) $*"
  [[ -f "${root}/${env}/${run}/${name}/eval_${split}.md" ]] ||
    "${python}" -m agentgym_jax.evaluate --config="experiments/tiny/${env}.py:stage=bc" \
        --checkpoint="${root}/${env}/${run}" --output="${root}/${env}/${run}/${name}" \
        --split="${split}" "$@" > "${root}/${env}/${run}_${name}.log" 2>&1
  grep -E "Pass@|Avg@" "${root}/${env}/${run}/${name}/eval_${split}.md"
}

sample() {  # sample ENV RUN: held-out success at temperature 1, 4 samples per test task
  evaluate "$1" "$2" eval_avg4 test --num_samples=4 --temperature=1.0
}

for part in "${parts[@]}"; do
  case "${part}" in
    babyai)
      mkdir -p "${root}/babyai"
      train babyai bc "stage=bc"
      train babyai bc_more "stage=bc_more,init=${root}/babyai/bc"
      algos=(grpo ppo reinforce_pp rloo gigpo turn_ppo)
      for algo in "${algos[@]}"; do
        train babyai "${algo}" "stage=rl,algo=${algo},init=${root}/babyai/bc"
      done
      # GiGPO as verl-agent's ALFWorld runs set it.
      train babyai gigpo_mean_norm "stage=rl,algo=gigpo,init=${root}/babyai/bc" \
          --config.algo.estimator_kwargs.step_norm=mean_norm --config.algo.gamma=0.95
      for algo in grpo gigpo; do  # with a KL term to the BC policy
        train babyai "${algo}_kl" "stage=rl,algo=${algo},init=${root}/babyai/bc" \
            --config.algo.kl_coef=0.1
      done
      # From the sharper second-cycle BC policy, for more steps.
      for algo in grpo ppo; do
        train babyai "${algo}_bc_more" "stage=rl,algo=${algo},init=${root}/babyai/bc_more" \
            --config.total_steps=30 --config.eval.every_steps=6 --config.checkpoint.every_steps=7
      done
      for run in bc bc_more "${algos[@]}" gigpo_mean_norm grpo_kl gigpo_kl grpo_bc_more \
          ppo_bc_more; do
        sample babyai "${run}"
      done ;;
    textcraft)  # RL starts from the second BC cycle: the first one's policy has no success
      mkdir -p "${root}/textcraft"
      train textcraft bc "stage=bc"
      train textcraft bc_more "stage=bc_more,init=${root}/textcraft/bc"
      for algo in grpo ppo; do
        train textcraft "${algo}" "stage=rl,algo=${algo},init=${root}/textcraft/bc_more"
      done
      # A third cycle: memorises the train goals without reading new ones (README).
      train textcraft bc_third "stage=bc_more,init=${root}/textcraft/bc_more" \
          --config.total_steps=128
      for run in bc_more bc_third grpo ppo; do
        sample textcraft "${run}"
      done
      for run in bc_more bc_third; do  # greedy on the goals it cloned: memorised or read?
        evaluate textcraft "${run}" eval_train train
      done ;;
    horizon)
      for horizon in short long scaling_inter; do
        train babyai "h_${horizon}" "stage=rl,algo=grpo,horizon=${horizon},init=${root}/babyai/bc"
      done ;;
    seeds)
      for algo in grpo ppo gigpo; do
        train babyai "${algo}_s1" "stage=rl,algo=${algo},seed=1,init=${root}/babyai/bc"
        sample babyai "${algo}_s1"
      done
      train babyai gigpo_kl_s1 "stage=rl,algo=gigpo,seed=1,init=${root}/babyai/bc" \
          --config.algo.kl_coef=0.1
      sample babyai gigpo_kl_s1 ;;
    *) echo "unknown part ${part}; use babyai, textcraft, horizon or seeds" >&2; exit 2 ;;
  esac
done
"${python}" experiments/tiny/plot.py --root="${root}" --out=experiments/tiny
