#!/usr/bin/env bash
# Run every rank of one model version as its own process, MindSpore Lite style:
# no scheduler, no gateway; the ranks meet over RabbitMQ under one run id, each gets
# the same input (ones, or the .npy files given after the version folder), and each
# prints its outputs (name, size in bytes, element count, first 10 elements).
#
#   shardserve export matmul --out models --rank-size 2
#   examples/run_ranks.sh models/matmul/1                # ranks 0..rank_size-1
#   examples/run_ranks.sh models/matmul/1 x.npy          # with an input file
#
# Environment: SHARDSERVE_AMQP_URL (broker), CONFIG (ini file, default: the
# config.ini next to this script), RUN_ID (default: a fresh one per call, so two
# calls never mix), TIMEOUT (seconds to wait for peers, default 60).
set -euo pipefail

version_dir=${1:?usage: run_ranks.sh MODELS/SERVABLE/VERSION [INPUT.npy ...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
config=${CONFIG:-$here/config.ini}
run_id=${RUN_ID:-run-$$-$RANDOM}
rank_size=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["rank_size"])' \
    "$version_dir/group.json")
inputs=()
if [ "$#" -gt 0 ]; then inputs=(--inputs "$@"); fi

pids=()
for ((rank = 0; rank < rank_size; rank++)); do
    shardserve run-rank --model "$version_dir" --rank "$rank" --config "$config" \
        --run-id "$run_id" --timeout "${TIMEOUT:-60}" "${inputs[@]}" &
    pids+=($!)
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
