#!/bin/bash
# step: look at the log
head app.log
# step: count the ERROR lines
grep -c ERROR app.log > count.txt
