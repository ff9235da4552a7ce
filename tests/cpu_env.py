"""The XLA flags of every test process: conftest's, and those of the processes tests start."""


def xla_flags(devices: int) -> str:
    """`devices` fake CPU devices, compiled with XLA:CPU's loop emitters: they compile a tiny train step ~25% faster
    than its fusion emitters, and it runs as fast."""
    return f"--xla_force_host_platform_device_count={devices} --xla_cpu_use_fusion_emitters=false"
