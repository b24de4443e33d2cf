"""The developer commands' Python: ``python -m scripts.gpu_handoff_demo`` is the
demo that ``scripts/demo`` starts."""
