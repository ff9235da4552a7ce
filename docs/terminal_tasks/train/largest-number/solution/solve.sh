#!/bin/bash
# step
sort -n numbers.txt | tail -1 > largest.txt
