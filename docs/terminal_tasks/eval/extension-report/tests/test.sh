#!/bin/bash
diff <(printf 'gz 1\nlog 3\ntxt 2\n') /app/report.txt
