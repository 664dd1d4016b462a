"""The deployment: what a topology is, how it becomes one config per process, and what
every process shares to start, stop, log and export metrics. Nothing here is a message
between processes (those are in ``protocol``)."""
