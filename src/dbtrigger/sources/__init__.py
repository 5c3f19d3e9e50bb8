"""Source adapters: where rows come from."""
