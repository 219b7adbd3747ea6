#!/usr/bin/env bash
# GPU check of `dsv4-tl bench` against peers found where a user has them (issue 27). On a
# lent GPU machine (device tool), from the repository root, carrying .devbundle and .peers:
#   bash scripts/device_bench_installed.sh
# The peer bundle is laid out as an installed vLLM (python -m dsv4_tl.bench_discovery) in a
# site directory put on PYTHONPATH, and PEERS_DIR is unset: `dsv4-tl bench --peers list` and
# the --shape rows must find FlashMLA and the Triton kernels in that vllm. Then the GPU test of
# the discovered FlashMLA. Writes $OUT/env.txt, peers_list.txt, shape_*.txt/json, pytest.log.
# SHAPES (space-separated --shape values) and SHAPE_TIMEOUT (s per shape) override the defaults.
set -uo pipefail
source scripts/device_setup.sh
BUNDLE=$PEERS_DIR
SITE=/tmp/user_site
SHAPES=${SHAPES:-"decode:h=64,b=64,extra=c4a:512 prefill:h=64,s_q=1024,topk=640,s_kv=8192"}
python3 -m dsv4_tl.bench_discovery "$BUNDLE" "$SITE"
user_env() { env -u PEERS_DIR PYTHONPATH="$SITE:$PYTHONPATH" "$@"; }
user_env python3 -m dsv4_tl.cli bench --peers list 2>&1 | tee "$OUT/peers_list.txt"
PEERS_DIR=$BUNDLE python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/integration/test_bench_discovery_gpu.py 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
for shape in $SHAPES; do
  name=shape_${shape%%:*}
  user_env timeout "${SHAPE_TIMEOUT:-150}" python3 -m dsv4_tl.cli bench --shape "$shape" \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt"
  echo "bench --shape $shape: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
done
exit "$status"
