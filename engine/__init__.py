"""The scheduler side, above everything: the serving driver over both services, the demo and its
report, and the local stack runner. Nothing in the repository imports this package."""
