#!/bin/bash
# step: see what is there
ls logs
# step: count the extensions
ls logs | sed 's/.*\.//' | sort | uniq -c | awk '{print $2, $1}' > report.txt
# step: check the report
cat report.txt
