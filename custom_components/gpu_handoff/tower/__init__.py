"""Tower agent of GPU Handoff (installed on the tower as gpu-handoff)."""
