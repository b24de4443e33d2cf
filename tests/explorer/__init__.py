"""The explorer: every interleaving of a few events, over the controller's
pure decisions (see search.py and model.py; ``scripts/explore``)."""
