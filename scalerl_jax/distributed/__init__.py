"""Multi-process plumbing: a host channel between processes and rendezvous through jax.distributed.

`channel`: authenticated, framed msgpack messages over TCP (no pickle), with waits that end and
errors that name the lost peer. `coordination`: barriers, a key-value rendezvous and run-once
side effects over the key-value store that `jax.distributed.initialize` already provides.
Importing this package imports neither module (the channel must not pull in jax).
"""
