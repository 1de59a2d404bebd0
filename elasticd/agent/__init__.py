"""The node agent: supervision loop, control channel, records, preemption, sd_notify."""
