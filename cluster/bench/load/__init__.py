"""`tandem bench serve`: a load harness for any OpenAI-compatible endpoint (vLLM `bench serve` flags and keys).

    datasets.py   what is sent: random, shared-prefix, multi-turn conversations, a JSONL file
    arrivals.py   when it is sent: Poisson / gamma arrival offsets (pure)
    client.py     one client: streams requests at those offsets under a concurrency cap, times them
    transport.py  the HTTP adapter it streams through (aiohttp when installed, else httpx)
    metrics.py    raw per-request samples -> the result dict and the console summary (pure)
    multinode.py  N clients as Ray actors spread over nodes; their samples merged exactly
    plots.py      latency CDFs, throughput and running requests over time, sweep curves (matplotlib)
    runner.py     the command: server (given or started here), sweep, offline baseline, saving
    args.py       its flags
"""
