"""Constants for the GPU Handoff integration."""

from typing import Final

DOMAIN: Final = "gpu_handoff"

DEFAULT_SSH_PORT: Final = 22
