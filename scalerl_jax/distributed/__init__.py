"""A run over several processes (jax.distributed, one controller per process).

`roles`: who generates, who trains, who leads (the design: read its docstring first).
`launch_env`: the `jax.distributed.initialize` arguments from explicit or SLURM variables.
`channel`: authenticated, framed msgpack messages over TCP (no pickle), with waits that end and
errors that name the lost peer. `coordination`: barriers, a key-value rendezvous and run-once
side effects over the key-value store that `jax.distributed.initialize` already provides.
`wiring`: the connections each process opens. `watchdog`: heartbeats; a lost process stops all.
`trainer_group`: the leader's operations repeated by the follower trainers, batches by rows.
`remote_generator`: a generator process's link to the leader's buffer, params and eval inbox.
`weight_push`: params to generators device to device (in place, or by weight transfer) and
`transport`: which route each generator's params take, evaluation routing.
`messages`: admissions and completions as plain data for the channel.
Importing this package imports none of them (the channel must not pull in jax).
"""
