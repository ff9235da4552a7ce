#!/bin/bash
# A reward file: the grader may give partial credit (here: 0.5 for a number that is in the file but not the largest).
answer="$(cat /app/largest.txt 2>/dev/null)"
if [ "$answer" = 250 ]; then echo 1 > /logs/verifier/reward.txt
elif grep -qx -- "$answer" /app/numbers.txt; then echo 0.5 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
