#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
make lib > /dev/null 2>&1 || echo build failed
( EXPCACHE_STAGING_TRACE=$R/transfer_trace.csv timeout 120 python3 -m pyexpcache transfer --gib 0.25 --detail --sources pageable ) > $R/transfer.txt 2>&1
( EXPCACHE_STAGING_TRACE=$R/decode_trace.csv EXPCACHE_STAGING_TRACE_PIECES=60000 timeout 200 python3 -m pyexpcache bench --quiet --source pageable --traces podA_c_python_full --variants expcache ) > $R/decode.txt 2>&1
gzip $R/*.csv; ls -la $R
