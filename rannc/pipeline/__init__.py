"""The runtime: stage executors, row redistribution between stages, the schedule."""
