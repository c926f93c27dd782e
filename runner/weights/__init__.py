"""runner/weights: checkpoint reading (checkpoint.py), the all-or-nothing loader (loader.py), the update
routes that end in it (routes.py) and the registry of distributed update groups (update_groups.py)."""
