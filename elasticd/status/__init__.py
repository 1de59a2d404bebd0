"""`elasticd status` and the agent's Prometheus metrics.

- model.py: read a job from etcd in one range read, derive its state (pure functions)
- jsondoc.py + schema.json: the versioned ``--json`` documents (docs/status.md)
- render.py: rich tables; watch.py: ``--watch`` from an etcd watch
- options.py, output.py, cli.py: the command (``add_parser``/``run``)
- metrics.py: ``AgentMetrics``, served for Prometheus by the agent
- synthetic.py: writes a synthetic job into a test etcd (tests and benchmarks)
"""
