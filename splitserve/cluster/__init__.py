"""The cluster bus: worker registry, KV events and load reports shared by routers,
workers and the operator's autoscaler."""
