"""KV connectors: KV blocks kept outside the engine (base.py: the interface; the offloading connector over a
disk store of block files, so a prompt prefix outlives the process; factory.py builds the engine's)."""
