"""`tandem serve`: the Ray cluster (a private local Ray, the controller, the worker actors), its
config, and the launcher that wires the dispatcher and the gateway to it. The only importers of `ray`."""
