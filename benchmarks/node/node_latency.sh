#!/usr/bin/env bash
# End-to-end latency and throughput of the ROS node, image publisher in another process.
#
# Run from the repository root ON THE GPU MACHINE (CPython 3.12 + torch, no ROS, no
# registry), carrying .whl/fi (FlashInfer wheels) and .whl/ros312_bundle.tar.xz (made
# here by benchmarks/node/node_latency_bundle.sh):
#
#   bash benchmarks/node/node_latency.sh [--frames 300] [--rate 15] [--heights "378 294"]
#   bash benchmarks/node/node_latency.sh --frames 300 --rate 15 --heights 378 --compare-selector
#   PYTHON=.venv/bin/python bash benchmarks/node/node_latency.sh --cpu-smoke   # this script, on a CPU
#   bash benchmarks/node/node_latency.sh --frames 300 --rate 15 --heights 378 \
#       -- --node-param state_directory=/tmp/lingbot_state   # the same with the keyframe journal on
#
# What it does, all offline:
#   1. installs FlashInfer into /tmp/site, unpacks the ROS 2 bundle into /tmp/lingbot_ros
#      (benchmarks/node/ros_env.sh: PYTHONPATH, LD_LIBRARY_PATH, AMENT_PREFIX_PATH);
#      ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and a private ROS_DOMAIN_ID;
#   2. checks ROS with a two-process Image + Status round trip (benchmarks/node/ros_roundtrip.py);
#   3. per frame height: benchmarks/node/node_latency.py (the graph of lingbot-map-demo,
#      lingbot_map_ros/cli/demo.py, with a warm-up and a JSON of the measurement) starts the node
#      (released architecture, RANDOM weights seeded 0, CUDA, bf16, flashinfer-fa3, CUDA
#      graphs, width 518) and the image folder publisher as two processes, records poses
#      in its own process, loops generated 518xH frames until --warmup-poses poses came
#      back (model load, FlashInfer JIT ~90 s on a fresh machine, CUDA-graph capture,
#      window filling: excluded), then publishes --frames frames at --rate Hz and
#      measures image header stamp -> pose received (same clock).
#      With --keyframe-selector it also starts the reference keyframe client
#      (lingbot_map_ros/ros/keyframe_selector.py) against the node before the warm-up and sets
#      the node's decision hold (keyframe_decision_timeout = --decision-timeout, default 0.5 s:
#      each stored frame after the scale frames waits for the selector's keep/drop before the
#      next frame is stored); --compare-selector runs each height without, then with it.
# Results in $OUT (default ./node_latency_out), few files (the device tool returns at most
# 8): node_latency_518xH.json per height (latency median/p95/p99/max, frames
# published/processed/dropped, output rate, the node's own per-frame model/total times,
# window restarts, GPU memory; the run's commit, device, command and date), with the selector
# node_latency_518xH_selector.json (the same, plus the node's decisions kept/dropped/timed
# out/refused over the timed part, the decision round trip and the frames that waited behind
# a hold, defined in lingbot_map_ros/cli/demo_selector.py), node_latency.log (this script's output, env included) and
# logs.tar.gz (env.txt, per run: node.log, publisher logs, params.yaml; the run folders
# themselves are under $RUNS, default /tmp/node_latency_runs). Each run is bounded so that
# the whole script ends before --deadline seconds (default 560); a height that no longer
# fits is skipped and says so.
#
# Options: --frames N --rate HZ --heights "H..." --width W --warmup-poses N
#   --startup-timeout S --deadline S --device D --backend B --dtype T --preset P
#   --input-qos reliable|sensor_data (default reliable: with a best-effort subscription a
#               587 KB raw 518x378 image over DDS on one host is often lost in transport
#               (fragments), which would measure the transport, not the node)
#   --no-dds-profile (do not export FASTDDS_DEFAULT_PROFILES_FILE=config/fastdds_large_messages.xml
#               for the node and the publisher: raw 518x378 images then exceed Fast DDS's
#               default 512 KB shared-memory segment and travel as UDP fragments, ~10 ms more)
#   --probe    run the node under benchmarks/node/node_probe.py (GIL waits, GC pauses, timed per-frame
#               parts, CPU per thread) and keep its report as node_probe_518xH.json in $OUT
#   --simulate MS  the real node with a simulated MS-ms model step instead of the model (no GPU:
#               tiny preset on cpu, --probe implied): the node's own overhead and frame losses
#   --no-probe-report  with --simulate: no probe threads or report (the probe's own load can hide
#               small differences; the simulated step still runs through node_probe.py)
#   --executor auto|events|single  the node's callback executor (default: the node's, auto); A/B runs
#   --gil-switch-ms MS  the node's GIL switch interval (default: the node's, 0.5; Python's own is 5)
#               (either runs the node through node_probe.py, without its report unless --probe)
#   --keyframe-selector  only the runs with the selector in the loop (files *_selector.json)
#   --compare-selector   per height, a run without and one with the selector, back to back
#               (a COMPARE line in the log: latency, output rate and drops with vs without)
#   --decision-timeout S the node's keyframe_decision_timeout with the selector (default 0.5)
#   --no-bundle (use this python's own ROS/FlashInfer: no install step)
#   --cpu-smoke (a quick local check of this script: --no-bundle, tiny preset on cpu,
#               width 98, heights 70, 12 frames at 5 Hz, 5 warm-up poses)
#   -- ARGS     passed on to node_latency.py (the demo's options, e.g. --node-param window_frames=1000)
# Node parameters are the node's defaults (the demo's finer map voxel is set back to 0.01)
# except those named above; with 80 warm-up + 300 timed frames the default window_frames
# (320 stored frames) restarts the cache window once inside the timed part, as on a long
# stream (the JSON counts window_restarts; --node-param window_frames=1000 avoids it).
# PYTHON selects the interpreter (default python3). LINGBOT_COMMIT names the commit in the
# results when the tree is not a git checkout (the device machine's copy may not be one).
set -uo pipefail
COMMAND="bash benchmarks/node/node_latency.sh${*:+ $*}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./node_latency_out}
PYTHON=${PYTHON:-python3}
FRAMES=300 RATE=15 HEIGHTS="378" WIDTH=518 WARMUP=80 STARTUP_TIMEOUT=420 TIMEOUT=60 DEADLINE=560 INPUT_QOS=reliable
DEVICE=cuda BACKEND=flashinfer-fa3 DTYPE=bf16 PRESET=lingbot-map BUNDLE=1 DDS_PROFILE=1 PROBE=0 NO_REPORT=0 SIM_MS=""
SELECTOR_MODES="off" DECISION_TIMEOUT=0.5 EXECUTOR="" GIL_MS=""
EXTRA=()
while (( $# )); do
  case "$1" in
    --frames) FRAMES=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --heights) HEIGHTS=$2; shift 2 ;;
    --width) WIDTH=$2; shift 2 ;;
    --warmup-poses) WARMUP=$2; shift 2 ;;
    --startup-timeout) STARTUP_TIMEOUT=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --preset) PRESET=$2; shift 2 ;;
    --input-qos) INPUT_QOS=$2; shift 2 ;;
    --no-bundle) BUNDLE=0; shift ;;
    --no-dds-profile) DDS_PROFILE=0; shift ;;
    --probe) PROBE=1; shift ;;
    --no-probe-report) NO_REPORT=1; shift ;;
    --keyframe-selector) SELECTOR_MODES="on"; shift ;;
    --compare-selector) SELECTOR_MODES="off on"; shift ;;
    --decision-timeout) DECISION_TIMEOUT=$2; shift 2 ;;
    --executor) EXECUTOR=$2; shift 2 ;;
    --gil-switch-ms) GIL_MS=$2; shift 2 ;;
    --simulate) SIM_MS=$2 PROBE=1 PRESET=tiny DEVICE=cpu BACKEND=auto DTYPE=fp32; shift 2 ;;
    --cpu-smoke) BUNDLE=0 DEVICE=cpu BACKEND=auto DTYPE=fp32 PRESET=tiny WIDTH=98 HEIGHTS=70 FRAMES=12 RATE=5
                 WARMUP=5 STARTUP_TIMEOUT=120 DEADLINE=300; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "node_latency: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUNS=${RUNS:-/tmp/node_latency_runs}
rm -rf "$RUNS" && mkdir -p "$RUNS"
exec > >(tee -a "$OUT/node_latency.log") 2>&1
say() { echo "node_latency [$(printf '%4d' $SECONDS) s]: $*"; }
trap 'tar -czf "$OUT/logs.tar.gz" -C "$RUNS" . 2>/dev/null' EXIT

# ---- 1. environment ----------------------------------------------------------
if (( BUNDLE )); then
  [[ -d .whl/fi && -f .whl/ros312_bundle.tar.xz ]] || {
    say "missing .whl/fi or .whl/ros312_bundle.tar.xz: carry them (see benchmarks/node/node_latency_bundle.sh)"; exit 1; }
  # .whl/lz4 (optional): the lz4 module for the journals' default compression (without it a node
  # with a state_directory warns and journals raw)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fi/*.whl $(ls .whl/lz4/*.whl 2>/dev/null) 2>&1 \
    | grep -v "as the 'root' user" | tail -n 3
  bash benchmarks/kernels/fi_aot_cache.sh /tmp/site  # FlashInfer JIT caches carried in .ficache, if any
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  # shellcheck source=ros_env.sh
  source benchmarks/node/ros_env.sh "$ROOT/.whl/ros312_bundle.tar.xz" /tmp/lingbot_ros || exit 1
  say "FlashInfer in /tmp/site, ROS 2 bundle in /tmp/lingbot_ros"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST  # DDS stays on this machine
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-$((1 + $$ % 100))}
if (( DDS_PROFILE )); then
  export FASTDDS_DEFAULT_PROFILES_FILE="$ROOT/config/fastdds_large_messages.xml"
else
  unset FASTDDS_DEFAULT_PROFILES_FILE
fi
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  ROS_DOMAIN_ID=$ROS_DOMAIN_ID"
  echo "FASTDDS_DEFAULT_PROFILES_FILE=${FASTDDS_DEFAULT_PROFILES_FILE:-(unset)}"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo "${LINGBOT_COMMIT:-unknown}")"
  echo "command: $COMMAND"
  "$PYTHON" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("torch", "numpy", "flashinfer", "rclpy"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:  # report, do not stop
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
try:
    import torch
    if torch.cuda.is_available():
        print("gpu", torch.cuda.get_device_name(0), "cuda", torch.version.cuda)
except Exception:
    pass
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
    --format=csv,noheader
  command -v nproc >/dev/null && echo "cpus: $(nproc)"
} >"$RUNS/env.txt" 2>&1
cat "$RUNS/env.txt"

# ---- 2. ROS pre-flight -------------------------------------------------------------
if ! timeout 60 "$PYTHON" benchmarks/node/ros_roundtrip.py; then
  say "ROS round trip failed; not running the node"; exit 1
fi

if [[ "$SELECTOR_MODES" == *on* ]] && ! "$PYTHON" -c \
    'from lingbot_map_ros.msg import FrameInfo, Status; Status().decisions_kept' 2>/dev/null; then
  say "the ROS interfaces lack FrameInfo or Status.decisions_*: rebuild the bundle (benchmarks/node/node_latency_bundle.sh)"
  exit 1
fi
export LINGBOT_BENCH_COMMAND="$COMMAND"

# ---- 3. runs ---------------------------------------------------------------------
status=0
last_run=0
measured=" "  # the runs of this invocation that wrote their JSON
for H in $HEIGHTS; do
for SEL in $SELECTOR_MODES; do
  left=$(( DEADLINE - SECONDS ))
  name="${WIDTH}x$H"
  sel_args=()
  sel_text=""
  if [[ "$SEL" == on ]]; then
    name="${name}_selector"
    sel_args=(--keyframe-selector --decision-timeout "$DECISION_TIMEOUT")
    sel_text=", keyframe selector in the loop (decision timeout $DECISION_TIMEOUT s)"
  fi
  # A later run compiles nothing new (FlashInfer's JIT cache stays): ~60% of the first.
  if (( last_run > 0 && left < last_run * 6 / 10 + 30 )); then
    say "skipping $name: ${left} s left before --deadline $DEADLINE, the last run took ${last_run} s"
    status=1; continue
  fi
  say "run $name: $PRESET random weights, $DEVICE, $DTYPE, $BACKEND, $FRAMES frames at $RATE Hz after" \
      "$WARMUP warm-up poses$sel_text (limit ${left} s)"
  start=$SECONDS
  probe_args=()
  if (( PROBE )) || [[ -n "$EXECUTOR$GIL_MS" ]]; then
    probe_args=(--node-script benchmarks/node/node_probe.py)
    if (( NO_REPORT || ! PROBE )); then unset LINGBOT_PROBE_OUT; else export LINGBOT_PROBE_OUT="$OUT/node_probe_$name.json"; fi
  fi
  export LINGBOT_BENCH_EXECUTOR="$EXECUTOR" LINGBOT_BENCH_GIL_SWITCH_MS="$GIL_MS"
  if [[ -n "$SIM_MS" ]]; then export LINGBOT_SIM_STEP_MS="$SIM_MS"; else unset LINGBOT_SIM_STEP_MS; fi
  # SIGINT first: node_latency.py then stops the node and the publisher it started.
  timeout -s INT -k 15 "$left" "$PYTHON" benchmarks/node/node_latency.py \
    --preset "$PRESET" --seed 0 --device "$DEVICE" --backend "$BACKEND" --dtype "$DTYPE" \
    --width "$WIDTH" --height "$H" --frames "$FRAMES" --rate "$RATE" --warmup-poses "$WARMUP" \
    --startup-timeout "$STARTUP_TIMEOUT" --timeout "$TIMEOUT" --no-save-map \
    --node-param map_voxel_size=0.01 --node-param input_qos="$INPUT_QOS" \
    --domain-id "$ROS_DOMAIN_ID" --out "$RUNS/$name" --json "$OUT/node_latency_$name.json" \
    "${sel_args[@]}" "${probe_args[@]}" "${EXTRA[@]}"
  rc=$?
  last_run=$(( SECONDS - start ))
  if (( rc != 0 )); then
    say "run $name FAILED (exit $rc after $last_run s); tail of its node.log:"
    tail -n 25 "$RUNS/$name/node.log" 2>/dev/null
    status=1
    continue
  fi
  measured+="$name "
  "$PYTHON" - "$OUT/node_latency_$name.json" "$last_run" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
f, lat, m = d["frames"], d["latency_ms"], d["node_ms"]["model"]
print(f"node_latency: RESULT {d['setting']['frame_size'][0]}x{d['setting']['frame_size'][1]} "
      f"{d['setting']['backend']} {d['setting']['dtype']}: latency median {lat.get('median')} ms, "
      f"p95 {lat.get('p95')}, max {lat.get('max')}; output {d['output_rate_hz']} Hz "
      f"(input {d['setting']['rate_hz']} Hz); published {f['published']}, processed {f['processed']}, "
      f"dropped {f['dropped_stale']} stale / {f['dropped_invalid']} invalid / {f['dropped_error']} error; "
      f"node model median {m.get('median')} ms, p95 {m.get('p95')}; window restarts {d['window_restarts']}; "
      f"first pose after {d['startup'].get('first_pose_s')} s; run {sys.argv[2]} s")
dec = d.get("decisions")
if dec:
    n, rt, w = dec["node"], dec["round_trip_ms"], dec["hold_waits"]
    print(f"node_latency: RESULT decisions (timed part): kept {n['kept']}, dropped {n['dropped']}, timed out "
          f"{n['timed_out']}, refused {n['refused']}; round trip median {rt.get('median')} ms, p95 {rt.get('p95')}, "
          f"max {rt.get('max')} (n {rt['n']}); {w['frames']} frame(s) waited behind a hold"
          + (f" (median {w['ms']['median']} ms, max {w['ms']['max']})" if w["frames"] else "")
          + f"; the selector's own counters (whole run): {dec['selector']}")
EOF
done
  if [[ "$measured" == *" ${WIDTH}x$H "* && "$measured" == *" ${WIDTH}x${H}_selector "* ]]; then
    "$PYTHON" benchmarks/node/node_latency_compare.py "$OUT/node_latency_${WIDTH}x$H.json" \
      "$OUT/node_latency_${WIDTH}x${H}_selector.json"
  fi
done
say "done (exit $status); results in $OUT"
exit $status
