"""`splitserve bench`: a load generator for any OpenAI-compatible server.

metrics.py holds the metric definitions (pure, vLLM's meanings), arrivals.py and
workloads.py decide what is sent when, client.py is the thin HTTP/SSE layer,
runner.py drives a run, results.py and plots.py report it, serving.py is the CLI.
"""
