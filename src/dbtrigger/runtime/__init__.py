"""The tick lifecycle and the processes that drive it."""
