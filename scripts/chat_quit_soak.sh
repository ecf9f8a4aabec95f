#!/usr/bin/env bash
# Start `dflash-mlx chat` in a real terminal (tmux) and quit it with Ctrl+Q, N times: half right
# after it is ready, half with a turn in flight. Every quit must exit 0 with nothing on the
# screen but the shell's own lines (no abort, no traceback). Usage:
#   scripts/chat_quit_soak.sh [N=50] [extra chat args...]
set -u
n=${1:-50}; shift || true
command -v tmux >/dev/null || { echo "needs tmux (apt-get install tmux)"; exit 2; }
tm() { tmux -L "dflash-soak-$$" "$@"; }  # a private tmux server: other sessions stay untouched
work=$(mktemp -d)
fails=0; ok=0
for i in $(seq "$n"); do
  s="dflash-quit-$$-$i"
  tm new-session -d -s "$s" -x 120 -y 40 \
    "dflash-mlx chat $*; echo \$? > $work/$i.rc; sleep 2"
  for _ in $(seq 120); do
    sleep 0.5; tm capture-pane -p -t "$s" 2>/dev/null | grep -q "Message (Enter sends" && break
  done
  sleep 0.5
  mode=idle
  if (( i % 2 == 0 )); then
    mode=turn
    tm send-keys -t "$s" "Tell me a long story about a fox and a crow." Enter
    sleep "$(( (i / 2) % 4 )).$(( RANDOM % 10 ))"  # 0-3.9 s into the answer
  fi
  tm send-keys -t "$s" C-q
  for _ in $(seq 240); do sleep 0.5; [ -s "$work/$i.rc" ] && break; done  # a loaded machine
  rc=$(cat "$work/$i.rc" 2>/dev/null || echo timeout)
  screen=$(tm capture-pane -p -t "$s" 2>/dev/null | grep -iE "terminate|abort|traceback|error" | head -2)
  tm kill-session -t "$s" 2>/dev/null
  if [[ "$rc" == 0 && -z "$screen" ]]; then
    ok=$((ok + 1))
  else
    fails=$((fails + 1)); echo "quit $i ($mode): exit $rc ${screen}"
  fi
done
rm -rf "$work"
echo "$ok passed, $fails failed"
(( fails == 0 ))
