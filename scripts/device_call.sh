#!/usr/bin/env bash
# One call of the GPU check on a lent machine, over what scripts/device_bundle.py packed into
# .device/ (this call's carry, and earlier calls' where the machine kept them):
#
#   bash scripts/device_call.sh PARTS [gpu_check.py options]     # PARTS: comma-separated, or none
#
# Installs the audio extras and the dev set once (a later bundle's are not taken while the
# machine stays warm), keeps the weight chunks carried, unpacks the packaged weights once
# every chunk has come (checked by md5: a damaged archive is dropped, to be carried again,
# and the weight-free parts still run), then runs
# gpu_check.py's PARTS over a report folder that lasts as long as the machine (its /tmp),
# and returns that folder as $OUT/check.tgz, also when gpu_check.py runs past CHECK_SECONDS
# (default 540, inside the 600 s a call may take) and is stopped: what it wrote so far comes
# back; the folder is also copied to $OUT/report after every part, so that a call killed at
# the tool's own limit still returns the parts it finished. A call that asks for parts
# needing the weights on a machine without them stops at once (exit 3), running none of its
# parts. DEVICE_CHECK_HOME: that folder's parent
# (default /tmp/gpu-check).
set -uo pipefail
parts=${1:?"which gpu_check.py parts (comma-separated, or none)"}
shift
home=${DEVICE_CHECK_HOME:-/tmp/gpu-check}
mkdir -p "$home/chunks" "$home/site" "$home/report"
status=0

if [ -d .device/extras ] && [ ! -e "$home/extras.installed" ]; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$home/site" \
      .device/extras/*.whl; then
    rm -rf "$home/dev" && cp -r .device/extras/dev "$home/dev" && touch "$home/extras.installed"
  else
    echo "extras: pip could not install the carried wheels" >&2
    status=1
  fi
fi
for folder in .device/w*; do
  if [ -d "$folder" ]; then cp "$folder"/* "$home/chunks/"; fi
done
if [ ! -e "$home/weights.unpacked" ] && [ -f "$home/chunks/weights.info" ]; then
  read -r count md5 < "$home/chunks/weights.info"
  if ! [[ "$count" =~ ^[1-9][0-9]?$ ]]; then count=0; fi  # a weights.info device_bundle.py did not write
  chunks=()
  for i in $(seq -f %02g 1 "$count"); do
    if [ -f "$home/chunks/weights.tar.xz.$i" ]; then chunks+=("$home/chunks/weights.tar.xz.$i"); fi
  done
  if [ "$count" -eq 0 ] || [ "${#chunks[@]}" -lt "$count" ]; then
    echo "weights: ${#chunks[@]} of $count chunks so far"
  elif ! { cat "${chunks[@]}" > "$home/weights.tar.xz" && echo "$md5  $home/weights.tar.xz" | md5sum -c --quiet; }; then
    echo "weights: the archive is damaged (md5); its chunks are dropped: carry them again" >&2
    rm -rf "$home/chunks" && mkdir -p "$home/chunks"
    status=1
  elif tar -xJf "$home/weights.tar.xz" -C "$home/site"; then
    rm -f "$home"/chunks/weights.tar.xz.*
    touch "$home/weights.unpacked"
    echo "packaged weights unpacked into $home/site"
  else
    echo "weights: the archive is sound but could not be unpacked into $home/site (disk space?)" >&2
    status=1
  fi
  rm -f "$home/weights.tar.xz"
fi

export PYTHONPATH="$home/site${PYTHONPATH:+:$PYTHONPATH}"
# The parts that need the weights and the dev set: on a machine that lacks them (a fresh one,
# given after the chunk calls' machine went back) they would all skip, and the call's time be lost.
if [[ ",$parts," =~ ,(evaluate|transcribe|stream|compile-evaluate|lengths-evaluate), ]] \
    && ! { [ -e "$home/extras.installed" ] && [ -e "$home/weights.unpacked" ]; }; then
  echo "this machine lacks the extras or the packaged weights (a fresh one?): carry .device/extras and every" \
    ".device/w* again, back to back, before the parts $parts" >&2
  exit 3
fi
if [ "$parts" != none ]; then
  # What each part wrote comes back even if the call is killed before check.tgz is made.
  GPU_CHECK_MIRROR=${OUT:+$OUT/report} timeout "${CHECK_SECONDS:-540}" python3 scripts/gpu_check.py \
    --out "$home/report" --dev "$home/dev" --only "$parts" "$@" || status=$?
fi
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/check.tgz" -C "$home" report || status=1; fi
exit "$status"
