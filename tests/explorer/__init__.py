"""The explorer: every interleaving of a few events, over the controller's
pure decisions (see search.py and model.py; ``scripts/explore``).

Kinder than the world where the explorer's section of
docs/chaos-and-mutants.md says: a tower job's effect and a drain are one
step each, and the runner's steps are a mirror of runner.py, not its code."""
