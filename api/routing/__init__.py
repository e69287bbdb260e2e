"""Routing: the engines a router chooses among (fleet.py), the prompt's blocks as the engines'
caches name them (prefix.py), the policies (policies.py) and conditional disaggregation
(disagg.py). docs/design.md §22."""
