#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. EXPCACHE_COMMIT=$1 PYTHONUNBUFFERED=1
R=$OUT/r
bash benchmarks/gpu_report.sh $R build tests memcheck > /dev/null 2>&1
( timeout 40 python3 -m pyexpcache transfer --gib 0.2 --detail --sources pinned,pageable ) > $R/transfer.txt 2>&1
{ cat $R/device.txt $R/tests.txt $R/memcheck.txt $R/steps.log; echo "== python3 -m pyexpcache transfer --gib 0.2 --detail --sources pinned,pageable"; cat $R/transfer.txt; } > $R/verify.txt; rm -f $R/device.txt $R/steps.log $R/tests.txt $R/memcheck.txt $R/build.txt $R/transfer.txt
