"""Ablation configs: one small file per ablation, each changing one thing from `common.py`."""
