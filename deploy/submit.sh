#!/usr/bin/env bash
# Submit the batch job to a running Ray cluster. Rerunning the same command resumes an interrupted
# job (finished rows are skipped); on a finished job it is a no-op.
#
#   RAY_ADDRESS=http://<head-node>:8265 deploy/submit.sh \
#       input.path=s3://my-bucket/prompts/ output.path=s3://my-bucket/out/qwen3-4b/
#
# CONFIG       job config (default configs/qwen3_4b.yaml); further key=value arguments override it.
# RUNTIME_ENV  runtime env file (default deploy/runtime_env.yaml: pip pins); set it empty when the
#              cluster image already has the dependencies.
# S3 credentials come from the nodes' standard AWS environment (instance profile, IRSA, env vars).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address, e.g. http://127.0.0.1:8265}"
CONFIG=${CONFIG-configs/qwen3_4b.yaml}
RUNTIME_ENV=${RUNTIME_ENV-deploy/runtime_env.yaml}
args=(--address "$RAY_ADDRESS" --working-dir .)
if [[ -n "$RUNTIME_ENV" ]]; then
    args+=(--runtime-env "$RUNTIME_ENV")
fi
config=()
if [[ -n "$CONFIG" ]]; then
    config=(--config "$CONFIG")
fi
exec ray job submit "${args[@]}" -- python jobs/generate.py "${config[@]}" "$@"
