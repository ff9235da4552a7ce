"""Experiment configs: each file defines get_config() -> a locked ml_collections.ConfigDict."""
