#!/bin/bash
# On the lent H200 (device tool), from the repo root: install the carried wheels (.whl, see bench/README.md),
# build the assets, run a bench; results land in $OUT.
# usage: bash bench/device_run.sh calibrate|seed|offload|zoo|probe|saved|peak|wgrad [extra args]
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# LFA_BENCH_MEMORY_SNAPSHOT=DIR: every CUDA process of the bench writes its allocator history there (bench/memory_snapshot)
[ -n "${LFA_BENCH_MEMORY_SNAPSHOT:-}" ] && mkdir -p "$LFA_BENCH_MEMORY_SNAPSHOT" && export PYTHONPATH=$PWD/bench/memory_snapshot:$PYTHONPATH
# memory-light optimizers (bitsandbytes, badam): carried installed in .lowmem (bitsandbytes' wheel is 43 MB; the
# folder keeps only its CUDA 13 library)
[ -d .lowmem ] && export PYTHONPATH=$PWD/.lowmem:$PYTHONPATH
W=/tmp/w; mkdir -p $W
df -h /tmp | tail -1
nvidia-smi --query-gpu=name,memory.total,compute_cap,clocks.sm --format=csv,noheader
cmd=$1; shift
# offload.py builds the shapes its runs need; the other benches start from the 1.3B
case "$cmd" in
  offload|saved|peak|wgrad) ;;
  zoo|probe) [ -f $W/model/tokenizer.json ] || python3 bench/make_assets.py $W none 2>&1 | grep -v Warning ;;
  *) [ -f $W/model/config.json ] || python3 bench/make_assets.py $W 1.3b 2>&1 | grep -v Warning ;;
esac
if [ "$cmd" = calibrate ]; then
  [ -f $W/model_350m/config.json ] || python3 bench/make_assets.py $W 350m 2>&1 | grep -v Warning
  case " $* " in *6.7b*) [ -f $W/model_6.7b/config.json ] || python3 bench/make_assets.py $W 6.7b 2>&1 | grep -v Warning;; esac
  python3 bench/calibrate.py $W $OUT/calibration.json "$@" 2>&1 | grep -E "CALIB|Traceback|Error" | tee $OUT/calibrate.txt
fi
if [ "$cmd" = offload ] && ls .aio/*.deb >/dev/null 2>&1; then
  # NVMe offload: DeepSpeed's async I/O op needs libaio, which the image lacks (carried debs, unpacked aside)
  for f in .aio/*.deb; do dpkg -x $f /tmp/aio; done
  lib=$(dirname $(find /tmp/aio -name 'libaio.so*' | head -1))
  export CFLAGS="-I/tmp/aio/usr/include" CPATH=/tmp/aio/usr/include LDFLAGS="-L$lib" LIBRARY_PATH=$lib \
    LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} TORCH_CUDA_ARCH_LIST=9.0
  [ -e $lib/libaio.so ] || ln -s $(ls $lib/libaio.so.1* | head -1) $lib/libaio.so
  start=$(date +%s)
  python3 -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; print('aio compatible:', B().is_compatible()); B().load()" 2>&1 | grep -E "compatible|Error|error:" | head -5
  echo "aio op built in $(( $(date +%s) - start )) s"
fi
if [ "$cmd" = offload ]; then  # offload.py builds the model shapes its runs need
  timeout ${BENCH_TIMEOUT:-560} python3 bench/offload.py $W $OUT "$@" 2>&1 | grep -E "^BENCH|Traceback|Error" | tee $OUT/offload.txt
  (cd $OUT && tar czf offload_logs.tgz *.log && rm -f *.log)
fi
if [ "$cmd" = zoo ]; then  # model_zoo.py builds each zoo model, runs it, deletes it
  # repeatable in one call (zoo ...; zoo ...): rows append to model_zoo.json; each invocation's logs go to
  # zoo_logs/N/ and one archive of them all is rewritten (the device returns at most 8 files)
  timeout ${BENCH_TIMEOUT:-540} python3 bench/model_zoo.py $W $OUT "$@" 2>&1 | grep -E "^BENCH|^[A-Za-z].* (h200|h100|capped)|^model |Traceback|Error" | tee -a $OUT/zoo.txt
  [ -e $OUT/zoo_logs.tgz ] || rm -rf $W/zoo_logs  # the call's first invocation: no logs of an earlier call
  n=1; while [ -e $W/zoo_logs/$n ]; do n=$((n + 1)); done
  mkdir -p $W/zoo_logs/$n && (cd $OUT && mv -f *.log $(ls *.jsonl 2>/dev/null) $W/zoo_logs/$n/ 2>/dev/null)
  tar czf $OUT/zoo_logs.tgz -C $W zoo_logs
fi
if [ "$cmd" = probe ]; then  # memory_probe.py: pinned DeepSpeed plans at exact token counts
  timeout ${BENCH_TIMEOUT:-560} python3 bench/memory_probe.py $W $OUT "$@" 2>&1 | grep -E "^BENCH|^[a-z0-9-]+ +fp16|^label |Traceback|Error" | tee $OUT/probe.txt
  (cd $OUT && tar czf probe_logs.tgz *.log && rm -f *.log)
fi
if [ "$cmd" = saved ]; then  # saved_tensors_check.py: each zoo family's per-layer saved tensors vs lfa's terms
  timeout ${BENCH_TIMEOUT:-300} python3 bench/saved_tensors_check.py $OUT "$@" 2>&1 | grep -vE "^lfa: padding-free|Warning" | tee $OUT/saved.txt
fi
if [ "$cmd" = peak ]; then  # peak_probe.py: one micro-batch's activations and logits path, by precision path
  timeout ${BENCH_TIMEOUT:-300} python3 bench/peak_probe.py $OUT "$@" 2>&1 | grep -vE "^lfa: padding-free|Warning" | tee -a $OUT/peak.txt
  [ -f $OUT/peak_probe.json ] && mv $OUT/peak_probe.json $OUT/peak_probe_$(date +%s).json
fi
if [ "$cmd" = wgrad ]; then  # wgrad_check.py: master weights' fp32 gradient accumulation, hook vs fused GEMM (no training)
  timeout ${BENCH_TIMEOUT:-120} python3 bench/wgrad_check.py $OUT "$@" 2>&1 | grep -v Warning | tee -a $OUT/wgrad.txt
  [ -f $OUT/wgrad_check.json ] && mv $OUT/wgrad_check.json $OUT/wgrad_check_$(date +%s).json
fi
if [ "$cmd" = seed ]; then
  # repeatable in one call (seed ...; seed ...): each invocation's table and archive get their own number
  n=1; while [ -e $OUT/seed_$n.tgz ]; do n=$((n + 1)); done
  timeout ${BENCH_TIMEOUT:-520} python3 bench/seed_scenario.py $W $OUT/seed "$@" 2>&1 | grep -E "^BENCH|^run |^profile |^[a-z0-9_#.]+ +[a-z(]|Traceback|Error" | tee -a $OUT/seed.txt
  # one archive: the device returns few files, and none whose name has a '#' (repeats are seed_fix#2, capped#2)
  # what `lfa train` wrote at its end: report.html, the PNGs, ledger and events of every run
  for d in $W/seed/runs/*/; do r=$(basename "$d"); mkdir -p "$OUT/seed/reports/$r"
    cp "$d"/report.html "$d"/*.png "$d"/ledger.json "$d"/events.jsonl "$OUT/seed/reports/$r/" 2>/dev/null; done
  (cd $OUT && tar czf seed_$n.tgz seed && rm -rf seed)
fi
df -h /tmp | tail -1
