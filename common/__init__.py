"""The shared vocabulary every layer speaks (docs/design.md §1); it imports nothing else of tandem.

    config.py        EngineConfig, SamplingParams, ConfigError, `require`
    engine_flags.py  EngineConfig's command-line flags (declared once)
    protocol.py      the wire messages between the gateway's dispatcher and the workers, WorkerRole,
                     FinishReason, Failure, the `Worker` contract
    faults.py        how a fault confined to one request is reported (an error id, the traceback logged)
    relay.py         the token relay: a worker's messages to the gateway over one TCP connection
"""
