"""Goodput on public spot traces: measured per-event costs replayed over availability traces.

``costs`` turns a ``benchmarks/recovery.py`` run into per-launcher event costs, ``model``
replays a trace under them (pure arithmetic), ``replay`` is the command line.
"""
